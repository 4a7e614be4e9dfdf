"""Operator metrics (Prometheus, prefix modelfleet_operator_) and OpenTelemetry spans for reconciles."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import kopf
from modelfleet.dataplane.observability import install_tracing
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "modelfleet_operator_reconciles",
    "Reconciles run, by kind, trigger and result (ok, retry, error).",
    ["kind", "trigger", "result"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "modelfleet_operator_reconcile_duration_seconds",
    "Time a reconcile took, by kind.",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "modelfleet_operator_reconcile_errors",
    "Reconciles that failed, by kind and error type.",
    ["kind", "error"],
    registry=REGISTRY,
)

API_REQUESTS = Counter(
    "modelfleet_operator_api_requests",
    "Requests the reconciles made to the Kubernetes API, by HTTP method (kopf's own are not counted).",
    ["method"],
    registry=REGISTRY,
)
SKIPPED = Counter(
    "modelfleet_operator_skipped_triggers",
    "Triggers that needed no reconcile, by why: the operator's own write or an unchanged object "
    "(seen), or one that a reconcile started since covered (covered).",
    ["kind", "why"],
    registry=REGISTRY,
)

tracer = trace.get_tracer("modelfleet.operator")


@contextmanager
def observed_reconcile(
    kind: str, namespace: str, name: str, trigger: str, *, tracer_: trace.Tracer | None = None
) -> Iterator[trace.Span]:
    """Time, count and trace one reconcile; an exception is recorded and re-raised."""
    start = time.perf_counter()
    attributes = {
        "k8s.namespace.name": namespace,
        "modelfleet.kind": kind,
        "modelfleet.name": name,
        "modelfleet.trigger": trigger,
    }
    with (tracer_ or tracer).start_as_current_span(f"reconcile {kind}", attributes=attributes) as span:
        try:
            yield span
        except Exception as exc:
            retry = isinstance(exc, kopf.TemporaryError) or getattr(exc, "retryable", False)
            RECONCILES.labels(kind, trigger, "retry" if retry else "error").inc()
            RECONCILE_ERRORS.labels(kind, type(exc).__name__).inc()
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            raise
        else:
            RECONCILES.labels(kind, trigger, "ok").inc()
        finally:
            RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - start)


def setup_tracing() -> bool:
    """Install the exporter the OTEL_* variables ask for, by the rule all our services share."""
    return install_tracing("modelfleet-operator") is not None
