"""`modelfleet operator`: the command, its settings, and the reconcile metrics."""

from __future__ import annotations

import argparse

import pytest
from modelfleet.cli.commands import SUBCOMMANDS
from modelfleet.operator import cli
from modelfleet.operator.observability import REGISTRY, observed_reconcile
from modelfleet.operator.settings import OperatorSettings


def test_operator_subcommand_parses_its_options():
    parser = argparse.ArgumentParser(prog="modelfleet")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["operator", "-n", "team-a", "--namespace", "team-b", "--standalone"])
    assert (args.namespace, args.standalone, args.all_namespaces) == (["team-a", "team-b"], True, False)
    assert args.func is cli.run_operator
    with pytest.raises(SystemExit):
        parser.parse_args(["operator", "-n", "team-a", "--all-namespaces"])  # one or the other


def test_operator_is_registered_in_the_cli():
    assert SUBCOMMANDS["operator"].module == "modelfleet.operator.cli"
    assert SUBCOMMANDS["operator"].extras == ("operator",)
    assert SUBCOMMANDS["crds"].module == "modelfleet.operator.cli"
    assert SUBCOMMANDS["crds"].function == "add_crds_parser"


def test_settings_read_the_chart_environment(monkeypatch):
    monkeypatch.setenv("MODELFLEET_OPERATOR_NAMESPACES", "team-a, team-b,")
    monkeypatch.setenv("MODELFLEET_DATAPLANE_IMAGE", "registry.example/modelfleet:9")
    monkeypatch.setenv("MODELFLEET_MODEL_STORE_CLAIM", "store")
    monkeypatch.setenv("MODELFLEET_DATAPLANE_IMAGE_PULL_SECRETS", "pull-a,pull-b")
    settings = OperatorSettings()
    assert settings.namespaces == ["team-a", "team-b"]
    assert settings.dataplane_image == "registry.example/modelfleet:9"
    assert settings.model_store_claim == "store"
    assert settings.image_pull_secrets == ["pull-a", "pull-b"]


def test_bad_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv("MODELFLEET_DATAPLANE_IMAGE_PULL_POLICY", "Sometimes")
    with pytest.raises(ValueError, match="dataplane_image_pull_policy"):
        OperatorSettings()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_reconciles_are_counted_timed_and_errors_recorded():
    labels = {"kind": "InferenceModel", "trigger": "test"}
    ok_before = sample("modelfleet_operator_reconciles_total", **labels, result="ok")
    err_before = sample(
        "modelfleet_operator_reconcile_errors_total", kind="InferenceModel", error="RuntimeError"
    )
    count_before = sample("modelfleet_operator_reconcile_duration_seconds_count", kind="InferenceModel")
    with observed_reconcile("InferenceModel", "ns", "chat", "test"):
        pass
    with pytest.raises(RuntimeError), observed_reconcile("InferenceModel", "ns", "chat", "test"):
        raise RuntimeError("boom")
    assert sample("modelfleet_operator_reconciles_total", **labels, result="ok") == ok_before + 1
    assert sample("modelfleet_operator_reconciles_total", **labels, result="error") >= 1
    errors = sample("modelfleet_operator_reconcile_errors_total", kind="InferenceModel", error="RuntimeError")
    assert errors == err_before + 1
    assert (
        sample("modelfleet_operator_reconcile_duration_seconds_count", kind="InferenceModel")
        == count_before + 2
    )


def test_reconciles_are_traced():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with observed_reconcile("ModelVersion", "team-a", "chat-v1", "job", tracer_=tracer):
        pass
    with (
        pytest.raises(ValueError),
        observed_reconcile("InferenceModel", "team-a", "chat", "resync", tracer_=tracer),
    ):
        raise ValueError("no")
    ok, failed = exporter.get_finished_spans()
    assert ok.name == "reconcile ModelVersion" and ok.attributes["modelfleet.trigger"] == "job"
    assert ok.attributes["k8s.namespace.name"] == "team-a" and ok.attributes["modelfleet.name"] == "chat-v1"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.events[0].name == "exception"


def test_a_bad_environment_variable_is_one_line_and_exit_2(monkeypatch, capsys):
    from modelfleet.operator.settings import get_settings

    monkeypatch.setenv("MODELFLEET_OPERATOR_HEALTH_PORT", "eighty")
    get_settings.cache_clear()
    try:
        parser = argparse.ArgumentParser(prog="modelfleet")
        cli.add_parser(parser.add_subparsers())
        args = parser.parse_args(["operator", "--standalone"])
        assert args.func(args) == 2
    finally:
        get_settings.cache_clear()
    error = capsys.readouterr().err
    assert error.startswith("error: MODELFLEET_OPERATOR_HEALTH_PORT: ") and error.count("\n") == 1
