"""MODELFLEET_GPU_SHARING from the operator to the server: a pod on one NVIDIA GPU gets `mps`, so that its
versions' engine processes run their kernels side by side; the server reads it and starts its MPS daemon
(dataplane/server/gpu_sharing.py). Pods on several GPUs, other vendors' or CPUs get nothing: the server's
default, time-slicing, holds there."""

from __future__ import annotations

import pytest
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.settings import OperatorSettings


def pod_env(accelerator: str, count: int = 1, **operator: str) -> dict[str, str]:
    im = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {
            "hardware": {"accelerator": accelerator, "count": count},
            "traffic": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        },
    }
    settings = OperatorSettings(dataplane_image="registry.example/modelfleet:1", **operator)
    spec = InferenceModel.model_validate(im).spec
    container = serving.deployment(im, spec, settings)["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def server_settings(env: dict[str, str], monkeypatch) -> ServerSettings:
    monkeypatch.delenv("MODELFLEET_GPU_SHARING", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return ServerSettings()


def test_a_one_gpu_nvidia_pods_server_shares_its_gpu_through_mps(monkeypatch) -> None:
    env = pod_env("nvidia-h100")
    assert env["MODELFLEET_GPU_SHARING"] == "mps"
    assert server_settings(env, monkeypatch).gpu_sharing == "mps"


@pytest.mark.parametrize(
    ("accelerator", "count", "operator"),
    [
        ("nvidia-h100", 2, {}),  # tensor-parallel ranks under MPS: not tested, so not done
        ("nvidia-h100", 1, {"dataplane_gpu_sharing": "none"}),
        ("amd-mi300x", 1, {}),
        ("cpu", 1, {}),
    ],
)
def test_other_pods_keep_the_servers_default(accelerator, count, operator, monkeypatch) -> None:
    env = pod_env(accelerator, count, **operator)
    assert "MODELFLEET_GPU_SHARING" not in env
    assert server_settings(env, monkeypatch).gpu_sharing == "none"


def test_unknown_sharing_is_refused_by_name(monkeypatch) -> None:
    with pytest.raises(ValueError, match="dataplane_gpu_sharing"):
        OperatorSettings(dataplane_gpu_sharing="time-slicing")
    monkeypatch.setenv("MODELFLEET_GPU_SHARING", "time-slicing")
    with pytest.raises(ValueError, match="gpu_sharing"):
        ServerSettings()
