"""The three services log and trace by one set of rules (dataplane/observability.py)."""

from __future__ import annotations

import io
import json
import logging

import opentelemetry.trace
import pytest
from modelfleet.controlplane.core import telemetry as controlplane_telemetry
from modelfleet.dataplane import observability
from modelfleet.dataplane.server.tracing import provider_from_env
from modelfleet.operator import observability as operator_observability
from opentelemetry.sdk.trace import TracerProvider

OTEL_VARIABLES = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
)
ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


def exporters(provider: TracerProvider | None) -> list[str]:
    if provider is None:
        return []
    return [type(p.span_exporter).__name__ for p in provider._active_span_processor._span_processors]


def installed_by(setup, monkeypatch) -> TracerProvider | None:
    """The provider a component's set-up makes global (None: it sets none)."""
    installed: list[TracerProvider] = []
    monkeypatch.setattr(observability, "_installed", None)
    monkeypatch.setattr(opentelemetry.trace, "set_tracer_provider", installed.append)
    setup()
    return installed[0] if installed else None


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, []),
        (ENDPOINT, ["OTLPSpanExporter"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["OTLPSpanExporter"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["OTLPSpanExporter"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["ConsoleSpanExporter"]),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["ConsoleSpanExporter", "OTLPSpanExporter"]),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, []),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, []),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "TRUE"}, []),
    ],
)
def test_three_components_choose_the_same_exporters(monkeypatch, env, expected):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dataplane = provider_from_env()
    operator = installed_by(operator_observability.setup_tracing, monkeypatch)
    controlplane = installed_by(controlplane_telemetry.setup_tracing, monkeypatch)
    try:
        assert exporters(dataplane) == exporters(operator) == exporters(controlplane) == expected
        assert dataplane.get_tracer("t").start_span("s").is_recording() == bool(expected)
    finally:
        for provider in (dataplane, operator, controlplane):
            if provider is not None:
                provider.shutdown()


def test_service_name_from_otel_service_name(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert observability.tracer_provider("svc").resource.attributes["service.name"] == "svc"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pod-a")
    assert observability.tracer_provider("svc").resource.attributes["service.name"] == "pod-a"


def bare_root(monkeypatch) -> logging.Logger:
    """A root logger without handlers, as at a process's start (pytest's own are put back after); called
    in the test itself, as pytest adds its capturing handler between set-up and call."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    return root


def test_json_logs_one_object_a_line_with_the_current_span(monkeypatch):
    root = bare_root(monkeypatch)
    monkeypatch.setenv(observability.LOG_FORMAT_ENV, "json")
    observability.configure_logging("info")
    stream = io.StringIO()
    root.handlers[0].setStream(stream)
    log = logging.getLogger("modelfleet.test")
    log.info("outside %s", "spans")
    log.debug("not at info")
    with TracerProvider().get_tracer("t").start_as_current_span("request") as span:
        log.warning("inside")
        context = span.get_span_context()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["outside spans", "inside"]
    assert lines[0].keys() == {"time", "level", "logger", "message"}
    assert lines[1]["level"] == "WARNING" and lines[1]["logger"] == "modelfleet.test"
    assert lines[1]["trace_id"] == format(context.trace_id, "032x")
    assert lines[1]["span_id"] == format(context.span_id, "016x")


def test_text_logs_by_default(monkeypatch):
    root = bare_root(monkeypatch)
    monkeypatch.delenv(observability.LOG_FORMAT_ENV, raising=False)
    observability.configure_logging(logging.WARNING)
    stream = io.StringIO()
    root.handlers[0].setStream(stream)
    logging.getLogger("modelfleet.test").warning("plain")
    assert stream.getvalue().rstrip().endswith("WARNING modelfleet.test: plain")
    assert root.level == logging.WARNING


def test_logging_needs_no_tracing_sdk():
    """An engine process only logs: configuring text or JSON logs imports nothing of OpenTelemetry's SDK."""
    import subprocess
    import sys

    code = (
        "import sys; from modelfleet.dataplane.observability import configure_logging; "
        "configure_logging('info', json=False); import logging; logging.getLogger('x').info('hi'); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
