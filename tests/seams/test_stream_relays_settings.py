"""MODELFLEET_STREAM_RELAYS from the operator to the server's engines: a GPU pod's container gets the
operator's dataplane_stream_relays, the server reads it, and its loader builds each engine process with
that many relays (a CPU pod's engines are threads: it gets none). Unset, each engine gets one relay per
64 of the maxNumSeqs its InferenceModel's spec.engine gives it."""

from __future__ import annotations

import pytest
from modelfleet.dataplane.server.runtime import build_dataplane
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.settings import OperatorSettings


def inference_model(accelerator: str, engine: dict | None = None) -> dict:
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {
            "hardware": {"accelerator": accelerator, "count": 1},
            "traffic": [{"version": "v1", "weight": 100}],
            **({"engine": engine} if engine else {}),
        },
    }


def pod_env(accelerator: str, relays: int | None, engine: dict | None = None) -> dict[str, str]:
    im = inference_model(accelerator, engine)
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


@pytest.mark.parametrize(("max_num_seqs", "relays"), [(None, 4), (512, 8), (65, 2), (8, 1)])
def test_unset_the_server_gives_each_engine_relays_for_its_max_num_seqs(
    max_num_seqs, relays, monkeypatch, tmp_path
):
    """The operator leaves the count out; the server's loader sizes each engine's relays from the
    engine settings the operator wrote into the pod's serving manifest (spec.engine's maxNumSeqs)."""
    from modelfleet.dataplane.engine import engine_process
    from modelfleet.dataplane.server import loading
    from modelfleet.dataplane.server.dataplane import version_specs
    from modelfleet.operator.reconcile.traffic import PlannedVersion

    engine = {"maxNumSeqs": max_num_seqs} if max_num_seqs else None
    env = pod_env("nvidia-h100", None, engine)
    assert "MODELFLEET_STREAM_RELAYS" not in env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings()
    assert settings.stream_relays is None
    loader = build_dataplane(settings).manager.loader
    made = {}

    class Recorded:
        def __init__(self, model, *, stream_relays, send_timeout, **engine_kwargs):
            made.update(stream_relays=stream_relays, engine=engine_kwargs)

    monkeypatch.setattr(engine_process, "AsyncLLMProcess", Recorded)
    monkeypatch.setattr(loading, "torch_cuda_available", lambda: True)
    monkeypatch.setattr(loading, "artifact_format", lambda artifact: "torch")
    planned = [PlannedVersion("v1", 100, 100, "Ready", str(tmp_path), "Servable", "")]
    spec = InferenceModel.model_validate(inference_model("nvidia-h100", engine)).spec
    (version,) = version_specs(serving.render_manifest("chat", spec, planned))
    loader(version)
    assert made["stream_relays"] == relays
    assert made["engine"]["max_num_seqs"] == spec.engine.max_num_seqs


def test_a_cpu_pod_gets_no_relay_setting():
    assert "MODELFLEET_STREAM_RELAYS" not in pod_env("cpu", 3)


def test_a_negative_relay_count_is_refused_on_both_sides(monkeypatch):
    with pytest.raises(ValueError, match="dataplane_stream_relays"):
        OperatorSettings(dataplane_stream_relays=-1)
    monkeypatch.setenv("MODELFLEET_STREAM_RELAYS", "-1")
    with pytest.raises(ValueError, match="stream_relays"):
        ServerSettings()
