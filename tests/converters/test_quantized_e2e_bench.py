"""bench/quantized_e2e.py on the CPU: examples/model.yaml's quantized version converted by the conversion
Job's own command (int8 for nvidia-h100, validated relative to bf16) and served by the Deployment's
`modelfleet serve`, with the tiny demo model as its source; and that a failing step is named and exits 1.
The GPU run (1B/8B presets, fp8) is the same script with other arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from modelfleet.converters import validate

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "bench" / "quantized_e2e.py"
EXAMPLE = REPO / "examples" / "model.yaml"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import quantized_e2e

    return quantized_e2e


def model_yaml(tmp_path: Path, edit=None) -> Path:
    """examples/model.yaml with an engine the tiny demo model fits (2048 positions), and `edit` applied."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    docs[0]["spec"]["engine"] = {"maxModelLen": 512, "maxNumSeqs": 8}
    if edit:
        edit(docs)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def run(*args: str, timeout: float = 240) -> tuple[int, dict[str, dict], str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "demo-tiny", "--device", "cpu", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = {line["step"]: line for line in lines}
    assert len(steps) == len(lines), "a step printed twice"
    assert lines and lines[-1]["step"] == "done", proc.stdout + proc.stderr
    return proc.returncode, steps, proc.stderr


def test_local_paths_and_env_follow_the_pods(bench, tmp_path):
    from modelfleet.operator.settings import OperatorSettings

    local = bench.Local(tmp_path, OperatorSettings())
    assert (
        local.path("/mnt/pvc/modelfleet-models/artifacts/x")
        == f"{tmp_path}/pvc/modelfleet-models/artifacts/x"
    )
    assert local.path("/models/artifacts/x") == f"{tmp_path}/pvc/modelfleet-models/artifacts/x"
    assert local.path("/etc/modelfleet/manifest.yaml") == f"{tmp_path}/etc/manifest.yaml"
    assert local.path("/dev/termination-log") == f"{tmp_path}/termination-log"
    assert local.path("/modelsx/a") == "/modelsx/a" and local.path("pvc://models/chat") == "pvc://models/chat"
    container = {
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "ATTRS", "value": "k8s.pod.name=$(POD_NAME),x=1"},
            {"name": "HOME", "value": "/tmp"},
        ]
    }
    env = local.env(container, pod_name="chat-abc")
    assert env == {"POD_NAME": "chat-abc", "ATTRS": "k8s.pod.name=chat-abc,x=1", "HOME": f"{tmp_path}/tmp"}
    secret = {"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    with pytest.raises(ValueError, match="HF_TOKEN"):
        local.env(secret, pod_name="p")


@pytest.mark.slow
def test_int8_version_converts_validates_and_serves_on_cpu(tmp_path):
    from modelfleet.converters.formats import Target
    from modelfleet.operator.reconcile.conversion import conversion_command

    work = tmp_path / "work"
    code, steps, stderr = run(
        "-f", str(model_yaml(tmp_path)), "--dtype", "int8", "--serve", "int8", "--work-dir", str(work)
    )
    assert code == 0, (steps, stderr)
    assert list(steps) == [
        "build",
        "convert-int8",
        "serve-ready",
        "chat",
        "chat-stream",
        "serve-stop",
        "done",
    ]
    assert all(line["ok"] for line in steps.values())

    converted = steps["convert-int8"]
    # the Job's command for chat-v2's int8 target on the model's H100s, as the operator writes it
    out = "/mnt/pvc/modelfleet-models/artifacts/chat/v2/nvidia-h100-torch-int8"
    target = Target("nvidia-h100", "torch", "int8")
    assert converted["job"] == conversion_command("pvc://models/chat/v2", target, out)
    assert converted["exitCode"] == 0 and converted["target"] == target.as_dict()
    report = converted["validation"]
    assert report["passed"] and report["failures"] == []
    assert report["method"] == "quantized-kernels" and report["rule"] == "relative-to-bf16"
    assert report["baseline"]["dtype"] == "bf16"
    assert report["thresholds"]["relativeRatio"] == validate.RELATIVE_RATIOS["int8"]
    assert 0 < report["maxAbsLogitDiff"] <= report["thresholds"]["maxAbsLogitDiff"]
    # the artifact the operator records in the version's status (from the termination message) names both
    recorded = converted["artifact"]
    assert recorded["uri"] == "pvc://modelfleet-models/artifacts/chat/v2/nvidia-h100-torch-int8"
    assert recorded["validation"]["method"] == "quantized-kernels"
    assert recorded["validation"]["rule"] == "relative-to-bf16" and recorded["validation"]["passed"] is True
    artifact = work / "pvc" / "modelfleet-models" / "artifacts" / "chat" / "v2" / "nvidia-h100-torch-int8"
    assert json.loads((artifact / "manifest.json").read_text())["validation"] == report

    ready = steps["serve-ready"]
    assert ready["traffic"] == {"v1": 0, "v2": 100}  # v1 has no artifact: the operator gives v2 all of it
    assert ready["artifact"] == str(artifact)
    served = yaml.safe_load((work / "etc" / "manifest.yaml").read_text())
    assert served["models"][0]["versions"] == [
        {"name": "v2", "weight": 100, "artifact": str(artifact), "preload": True, "shadow_percent": 0}
    ]
    assert served["models"][0]["engine"]["max_model_len"] == 512
    for step in ("chat", "chat-stream"):
        assert steps[step]["version"] == "v2" and steps[step]["text"].strip()
        assert steps[step]["usage"]["completion_tokens"] == 16
    assert steps["serve-stop"]["exitCode"] in (0, -15)


@pytest.mark.slow
def test_a_failed_conversion_is_reported_and_nothing_is_served(tmp_path):
    work = tmp_path / "work"
    source = work / "pvc" / "models" / "chat" / "v2"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{not json")  # reused as the source: the converter refuses it
    code, steps, stderr = run(
        "-f", str(model_yaml(tmp_path)), "--dtype", "int8", "--serve", "int8", "--work-dir", str(work)
    )
    assert code == 1
    assert steps["convert-int8"]["ok"] is False and steps["convert-int8"]["exitCode"] == 2
    assert steps["convert-int8"]["reason"] == "InvalidSource"  # the operator's reason for exit 2
    assert steps["convert-int8"]["message"]
    assert steps["serve-ready"]["ok"] is False and "convert-int8 failed" in steps["serve-ready"]["error"]
    assert steps["done"]["failed"] == ["convert-int8", "serve-ready"]
    assert "chat" not in steps
    assert "failed steps: convert-int8, serve-ready" in stderr


def test_a_source_the_script_cannot_place_fails_the_build_step(tmp_path):
    def hf_source(docs):
        docs[2]["spec"]["source"]["uri"] = "hf://org/model"

    work = tmp_path / "work"
    yaml_path = model_yaml(tmp_path, hf_source)
    code, steps, _ = run("-f", str(yaml_path), "--dtype", "int8", "--serve", "none", "--work-dir", str(work))
    assert code == 1
    assert steps["build"]["ok"] is False and "only pvc:// and file://" in steps["build"]["error"]
    assert steps["done"] == {"step": "done", "ok": False, "failed": ["build"], "workDir": str(work)}
