"""What the API server does to a custom resource before it stores it: prune unknown fields, apply the CRD
schema's defaults, check the schema and its CEL rules, and refuse with kubectl's message.

The checks are the operator's offline mirror of the API server (`operator/schema_checks.py`), run against
the CRDs that `operator/crdgen.py` generates, so a model.yaml the cluster would refuse is refused here the
same way, before anything starts.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from modelfleet.operator import crdgen, schema_checks


class Refused(ValueError):
    """The API server would not store this object; the message is the one kubectl prints."""


@lru_cache(maxsize=1)
def crds() -> dict[str, dict[str, Any]]:
    """The generated CRDs, by kind."""
    return {crd["spec"]["names"]["kind"]: crd for crd in crdgen.all_crds().values()}


def admit(obj: Any, old: dict[str, Any] | None = None) -> dict[str, Any]:
    """The object as the API server stores it (pruned, defaulted), or `Refused` with its message.
    `old`: the stored object an update replaces (transition rules compare the two)."""
    if not isinstance(obj, dict):
        raise Refused(f"a document is not an object (got {type(obj).__name__}); each must be a resource")
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    if kind not in crds():
        raise Refused(
            f'no matches for kind "{kind}" in version "{api_version}": the local fleet takes '
            f"{' and '.join(crds())}"
        )
    try:
        return schema_checks.check_object(crds()[kind], obj, old)
    except schema_checks.Invalid as exc:
        raise Refused(str(exc)) from None
