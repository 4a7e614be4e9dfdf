"""MODELFLEET_STREAM_RELAYS from the operator to the server's engines: a GPU pod's container gets the
operator's dataplane_stream_relays, the server reads it, and its loader builds each engine process with
that many relays (a CPU pod's engines are threads: it gets none)."""

from __future__ import annotations

import pytest
from modelfleet.dataplane.server.runtime import build_dataplane
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.settings import OperatorSettings


def pod_env(accelerator: str, relays: int) -> dict[str, str]:
    im = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {
            "hardware": {"accelerator": accelerator, "count": 1},
            "traffic": [{"version": "v1", "weight": 100}],
        },
    }
    settings = OperatorSettings(
        dataplane_image="registry.example/modelfleet:1", dataplane_stream_relays=relays
    )
    spec = InferenceModel.model_validate(im).spec
    container = serving.deployment(im, spec, settings)["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.parametrize("relays", [0, 3])
def test_a_gpu_pods_server_builds_engines_with_the_operators_relays(relays, monkeypatch):
    env = pod_env("nvidia-h100", relays)
    assert env["MODELFLEET_STREAM_RELAYS"] == str(relays)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings()
    assert settings.stream_relays == relays
    loader = build_dataplane(settings).manager.loader
    assert loader.keywords == {"stream_relays": relays, "send_timeout": settings.send_timeout_seconds}


def test_a_cpu_pod_gets_no_relay_setting():
    assert "MODELFLEET_STREAM_RELAYS" not in pod_env("cpu", 3)


def test_a_negative_relay_count_is_refused_on_both_sides(monkeypatch):
    with pytest.raises(ValueError, match="dataplane_stream_relays"):
        OperatorSettings(dataplane_stream_relays=-1)
    monkeypatch.setenv("MODELFLEET_STREAM_RELAYS", "-1")
    with pytest.raises(ValueError, match="stream_relays"):
        ServerSettings()
