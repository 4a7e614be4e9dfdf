"""Prometheus metrics for HTTP requests and SQL statements, and OpenTelemetry spans for SQL statements.

FastAPI traces HTTP requests itself (server spans with W3C trace-context, dependency and endpoint spans)
once a tracer provider is set; `setup_tracing` sets one when the standard OTEL_* variables ask for an
exporter (dataplane/observability.py holds the rule all our services share), and the SQL spans here nest
under FastAPI's. Without one, the API's no-op tracer keeps the cost near zero.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from modelfleet.dataplane.observability import install_tracing
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram
from sqlalchemy import Engine, event

log = logging.getLogger(__name__)
TRACER_NAME = "modelfleet.controlplane"

HTTP_REQUESTS = Counter(
    "modelfleet_controlplane_http_requests_total", "HTTP requests answered", ["method", "route", "status"]
)
HTTP_LATENCY = Histogram(
    "modelfleet_controlplane_http_request_duration_seconds", "HTTP request latency", ["method", "route"]
)
DB_LATENCY = Histogram(
    "modelfleet_controlplane_db_query_duration_seconds",
    "SQL statement latency",
    ["operation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
DB_UNAVAILABLE = Counter(
    "modelfleet_controlplane_db_unavailable_total", "Requests refused: database unavailable"
)


def setup_tracing() -> None:
    """Install the exporter the OTEL_* variables ask for (once per process), by the shared rule."""
    install_tracing("modelfleet-controlplane")


class MetricsMiddleware:
    """Request count and latency by route template (plain ASGI: no body buffering)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = _route_template(scope)
            HTTP_LATENCY.labels(scope["method"], route).observe(time.perf_counter() - started)
            HTTP_REQUESTS.labels(scope["method"], route, str(status["code"])).inc()


def _route_template(scope: dict) -> str:
    """The path with its parameters put back as names (/api/v1/tenants/{tenant_name}), so that metric
    labels stay few; built from the matched path parameters, in their order along the path."""
    if scope.get("route") is None:
        return "unmatched"
    segments = scope["path"].split("/")
    start = 0
    for name, value in (scope.get("path_params") or {}).items():
        for index in range(start, len(segments)):
            if segments[index] == str(value):
                segments[index] = "{" + name + "}"
                start = index + 1
                break
    return "/".join(segments)


def instrument_engine(engine: Engine, tracer_provider: trace.TracerProvider | None = None) -> None:
    """A client span and a latency observation per SQL statement (the global provider by default)."""
    system = engine.dialect.name
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)

    @event.listens_for(engine, "before_cursor_execute")
    def _start(conn, cursor, statement, parameters, context, executemany) -> None:
        operation = statement.lstrip().split(" ", 1)[0].upper()
        span = tracer.start_span(f"{operation} {system}", kind=SpanKind.CLIENT)
        span.set_attribute("db.system.name", system)
        span.set_attribute("db.operation.name", operation)
        span.set_attribute("db.query.text", statement[:1000])
        conn.info.setdefault("modelfleet_spans", []).append((span, operation, time.perf_counter()))

    @event.listens_for(engine, "after_cursor_execute")
    def _end(conn, cursor, statement, parameters, context, executemany) -> None:
        _finish(conn, error=None)

    @event.listens_for(engine, "handle_error")
    def _failed(context) -> None:
        if context.connection is not None:
            _finish(context.connection, error=context.original_exception)


def _finish(conn: Any, *, error: BaseException | None) -> None:
    spans = conn.info.get("modelfleet_spans")
    if not spans:
        return
    span, operation, started = spans.pop()
    DB_LATENCY.labels(operation).observe(time.perf_counter() - started)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    span.end()
