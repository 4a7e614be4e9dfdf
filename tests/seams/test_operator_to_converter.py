"""The operator's conversion Job, read by the converter it runs: the host allow-list set in the chart
(MODELFLEET_CONVERSION_SOURCE_ALLOW_HOSTS) becomes the converter's own policy in the Job's environment, and
a version's spec.quantizeLmHead becomes the command line the real converter takes and acts on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from modelfleet.converters.cli import TERMINATION_LOG_ENV
from modelfleet.converters.errors import BadInputError
from modelfleet.converters.hosts import HostPolicy
from modelfleet.operator.api import ModelVersion
from modelfleet.operator.reconcile import conversion
from modelfleet.operator.reconcile.targets import Target, resolve_targets
from modelfleet.operator.settings import OperatorSettings

from tests.converters.test_convert import run_convert

MV = {
    "apiVersion": "modelfleet.dev/v1alpha1",
    "kind": "ModelVersion",
    "metadata": {"name": "chat-v1", "namespace": "team-a", "uid": "uid-v1"},
    "spec": {"model": "chat", "version": "v1", "source": {"uri": "https://models.internal/chat.tar"}},
}
TARGET = Target("cpu", "torch", "fp32")


def job_env(settings: OperatorSettings) -> dict[str, str]:
    job = conversion.conversion_job(MV, ModelVersion.model_validate(MV), TARGET, settings)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return {var["name"]: var["value"] for var in container["env"]}


def test_the_allow_list_reaches_the_converter():
    policy = HostPolicy.from_env(job_env(OperatorSettings(conversion_source_allow_hosts="10.0.0.0/8")))
    assert policy.address(httpx.URL("http://10.1.2.3/model.tar")) == "10.1.2.3"
    with pytest.raises(BadInputError, match="not in MODELFLEET_SOURCE_ALLOW_HOSTS"):
        policy.address(httpx.URL("http://169.254.169.254/latest/meta-data"))


def test_without_a_list_the_converter_keeps_its_safe_default():
    env = job_env(OperatorSettings())
    assert "MODELFLEET_SOURCE_ALLOW_HOSTS" not in env
    with pytest.raises(BadInputError, match="private address"):
        HostPolicy.from_env(env).address(httpx.URL("http://10.1.2.3/model.tar"))


def as_the_pod_runs_it(command: list[str], pvc_root: Path) -> list[str]:
    """The Job's `modelfleet convert` arguments with its mounts under `pvc_root` (the pod's /mnt/pvc) and
    the termination log left to $MODELFLEET_TERMINATION_LOG."""
    assert command[:2] == ["modelfleet", "convert"]
    args = [a.replace(conversion.PVC_ROOT, str(pvc_root), 1) for a in command[2:]]
    at = args.index("--termination-log")
    return args[:at] + args[at + 2 :]


def test_a_version_quantizing_lm_head_converts_as_its_jobs_say(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """On cpu the int8 torch artifact is listed explicitly (cpu's default int8 is onnx)."""
    shutil.copytree(tiny_model_dir, tmp_path / "pvc" / "models" / "chat" / "v1")
    monkeypatch.setenv("MODELFLEET_PVC_ROOT", str(tmp_path / "pvc"))
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(tmp_path / "termination-log"))
    mv = {**MV, "spec": {**MV["spec"], "source": {"uri": "pvc://models/chat/v1"}}}
    mv["spec"].update(
        quantization="int8",
        quantizeLmHead=True,
        targets=[{"accelerator": "cpu", "format": "torch", "dtype": d} for d in ("bf16", "int8")],
    )
    version = ModelVersion.model_validate(mv)
    artifacts = {}
    for target in resolve_targets(version.spec, "cpu"):
        job = conversion.conversion_job(mv, version, target, OperatorSettings())
        (container,) = job["spec"]["template"]["spec"]["containers"]
        code, summary, err = run_convert(capsys, *as_the_pod_runs_it(container["command"], tmp_path / "pvc"))
        assert code == 0, err
        result = conversion.parse_summary((tmp_path / "termination-log").read_text(), target, code)
        assert result.ok and result.artifact["uri"] == summary["uri"]
        artifacts[target.dtype] = result.artifact["uri"]
    assert artifacts == {
        "bf16": "pvc://modelfleet-models/artifacts/chat/v1/cpu-torch-bf16",
        "int8": "pvc://modelfleet-models/artifacts/chat/v1/cpu-torch-int8-lm-head",
    }
    folder = tmp_path / "pvc" / "modelfleet-models" / "artifacts" / "chat" / "v1"
    int8 = json.loads((folder / "cpu-torch-int8-lm-head" / "manifest.json").read_text())
    assert int8["quantization"]["lmHead"] is True and int8["validation"]["passed"]
    config = json.loads((folder / "cpu-torch-int8-lm-head" / "config.json").read_text())
    assert config["quantization_config"]["lm_head"] is True
    assert "quantization" not in json.loads((folder / "cpu-torch-bf16" / "manifest.json").read_text())
