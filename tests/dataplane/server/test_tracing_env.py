"""The span exporter comes from the standard OTEL_* variables."""

from __future__ import annotations

import pytest
from modelfleet.dataplane.server.tracing import provider_from_env
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def exporters(provider) -> list[type]:
    processors = provider._active_span_processor._span_processors
    return [type(p.span_exporter) for p in processors]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "console"}, [ConsoleSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, [OTLPSpanExporter]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, [OTLPSpanExporter]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"}, []),
    ],
)
def test_exporter_from_env(monkeypatch, env, expected):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pod-a")
    provider = provider_from_env()
    try:
        assert exporters(provider) == expected
        # spans nobody would receive are not recorded
        span = provider.get_tracer("test").start_span("request")
        assert span.is_recording() == bool(expected)
        span.end()
        assert provider.resource.attributes["service.name"] == "pod-a"
    finally:
        provider.shutdown()
