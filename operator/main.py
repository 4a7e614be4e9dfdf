"""`modelfleet operator`: run the kopf operator for InferenceModel and ModelVersion.

Replicas meet in a kopf peering object (MODELFLEET_OPERATOR_PEERING) so that only one acts at a time;
`--standalone` skips peering for development and tests. Without the peering CRD or object kopf would
wait in silence: `preflight.py` says so at start-up and in /healthz.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys

from modelfleet.operator.settings import OperatorSettings, get_settings
from pydantic import ValidationError


def load_settings() -> OperatorSettings | None:
    """The settings, or None after printing one line that names the bad environment variable."""
    try:
        return get_settings()
    except ValidationError as exc:
        error = exc.errors()[0]
        variable = f"MODELFLEET_{str(error['loc'][0]).upper()}" if error["loc"] else "MODELFLEET_*"
        print(f"error: {variable}: {error['msg']}; fix the environment variable", file=sys.stderr)
        return None


def _run(args: argparse.Namespace) -> int:
    settings = load_settings()  # before the handlers module, which reads them on import
    if settings is None:
        return 2
    import kopf
    from modelfleet.dataplane.observability import configure_logging
    from modelfleet.operator import handlers, preflight  # noqa: F401  (register their handlers with kopf)
    from modelfleet.operator.observability import REGISTRY, setup_tracing
    from prometheus_client import start_http_server

    namespaces = [] if args.all_namespaces else (args.namespace or settings.namespaces)
    standalone = args.standalone or settings.operator_standalone
    peering = args.peering or settings.operator_peering
    level = getattr(logging, settings.log_level.upper(), None)
    if not isinstance(level, int):
        print(
            f"error: MODELFLEET_LOG_LEVEL={settings.log_level!r} is not a log level; use info or debug",
            file=sys.stderr,
        )
        return 2
    configure_logging(level)
    if settings.operator_metrics_port:
        start_http_server(settings.operator_metrics_port, registry=REGISTRY)
    setup_tracing()
    health = settings.operator_health_port
    # Peers of equal priority all pause (kopf steps every one of them back), so each replica draws its
    # own: the highest acts, the others wait and take over when its keep-alives stop.
    priority = settings.operator_priority or secrets.randbelow(32767) + 1
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True if standalone else None,
        peering_name=None if standalone else peering,
        priority=priority,
        liveness_endpoint=f"http://0.0.0.0:{health}/healthz" if health else None,
        memo=kopf.Memo(namespaces=namespaces),  # the peering pre-flight names the objects it looks for
    )
    return 0
