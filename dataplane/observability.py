"""Logging and tracing set-up shared by the three services (data plane, operator, control plane).

It lives in the data plane because the data plane imports none of our other packages, while the operator
and the control plane may import it: one rule for the log format and one for the OTEL_* variables.

Logging: `configure_logging(level)` writes text lines, or with MODELFLEET_LOG_FORMAT=json one JSON object
a line (time, level, logger, message, and trace_id/span_id when a span is current).

Tracing: `tracer_provider(service)` reads OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER (none, otlp, console;
comma-separated), OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (an endpoint alone
means otlp) and OTEL_SERVICE_NAME. With no exporter, no span is recorded.
"""

from __future__ import annotations

import json as jsonlib
import logging
import os
import sys
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING

# The OpenTelemetry SDK is imported where tracing is set up, not for logging: an engine process that only
# logs starts without it.
if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

LOG_FORMAT_ENV = "MODELFLEET_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
EXPORTERS = ("otlp", "console")

log = logging.getLogger(__name__)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the current span's ids so that logs and traces join."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = format(context.trace_id, "032x")
            entry["span_id"] = format(context.span_id, "016x")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return jsonlib.dumps(entry, ensure_ascii=False)


def json_logs_wanted() -> bool:
    value = os.environ.get(LOG_FORMAT_ENV, "text").strip().lower()
    if value not in ("text", "json"):
        print(f"{LOG_FORMAT_ENV}={value!r}: expected text or json; using text", file=sys.stderr)
    return value == "json"


def configure_logging(level: int | str, json: bool | None = None) -> None:
    """Set up the root logger once per process (a no-op when it already has handlers, as basicConfig);
    `json` None follows MODELFLEET_LOG_FORMAT."""
    if isinstance(level, str):
        level = level.upper()
    if json is None:
        json = json_logs_wanted()
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


def exporter_names() -> list[str]:
    """The exporters the OTEL_* variables ask for, by the one rule all three services follow."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not named:
        has_endpoint = any(
            os.environ.get(v) for v in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        return ["otlp"] if has_endpoint else []
    names = [n.strip() for n in named.split(",") if n.strip() and n.strip() != "none"]
    for unknown in [n for n in names if n not in EXPORTERS]:
        log.warning("OTEL_TRACES_EXPORTER: %r is not one of %s; ignored", unknown, ", ".join(EXPORTERS))
    return [n for n in dict.fromkeys(names) if n in EXPORTERS]


def _exporter(name: str) -> SpanExporter:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if name == "console":
        return ConsoleSpanExporter()
    # Imported only when asked for; it reads its own OTEL_EXPORTER_OTLP_* settings.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def tracer_provider(service_name: str) -> TracerProvider:
    """A provider exporting where the OTEL_* variables say; OTEL_SERVICE_NAME overrides `service_name`."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    names = exporter_names()
    if not names:
        # Spans nobody receives are not recorded: building one costs tens of us per request. (With an
        # exporter, OTEL_TRACES_SAMPLER decides, as the SDK reads it.)
        return TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    provider = TracerProvider(resource=resource)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return provider


_installed_lock = threading.Lock()
_installed: TracerProvider | None = None


def install_tracing(service_name: str) -> TracerProvider | None:
    """Make `tracer_provider(service_name)` the process's global provider, once, when it exports;
    None when it would not (the API's no-op tracer then keeps the cost near zero)."""
    global _installed
    with _installed_lock:
        if _installed is not None:
            return _installed
        if not exporter_names():
            return None
        from opentelemetry import trace

        _installed = tracer_provider(service_name)
        trace.set_tracer_provider(_installed)
        log.info("tracing %s to %s", service_name, ", ".join(exporter_names()))
        return _installed
