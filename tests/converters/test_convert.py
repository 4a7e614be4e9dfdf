"""`modelfleet convert` on the tiny demo model: artifacts, manifests, validation, atomic publication."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from modelfleet.converters import validate
from modelfleet.converters.artifact import SUMMARY_LIMIT
from modelfleet.converters.cli import add_parser
from modelfleet.converters.download import sha256_file
from modelfleet.converters.sources import folder_digest
from safetensors import safe_open


def run_convert(capsys, *args: str) -> tuple[int, dict, str]:
    """Run the CLI in-process; returns (exit code, the summary parsed from the LAST stdout line, stderr)."""
    parser = argparse.ArgumentParser(prog="modelfleet")
    add_parser(parser.add_subparsers())
    parsed = parser.parse_args(["convert", *args])
    code = parsed.func(parsed)
    captured = capsys.readouterr()
    last = captured.out.strip().splitlines()[-1]
    return code, json.loads(last), captured.err


def leftovers(folder: Path) -> list[str]:
    """Staging or replaced folders left next to the artifacts (the cache folder is expected)."""
    return sorted(
        p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != ".modelfleet-cache"
    )


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_torch_bf16_artifact_manifest_and_summary(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "art" / "cpu-bf16"
    code, summary, _ = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--out", str(out)
    )
    assert code == 0, summary
    assert summary["ok"] is True
    assert (summary["accelerator"], summary["format"], summary["dtype"]) == ("cpu", "torch", "bf16")
    assert summary["uri"] == out.as_uri()

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "torch" and manifest["dtype"] == "bf16" and manifest["accelerator"] == "cpu"
    assert manifest["source"]["digest"] == folder_digest(tiny_model_dir)[0]
    assert manifest["converter"]["version"] and manifest["createdAt"].endswith("Z")
    listed = {f["path"]: f for f in manifest["files"]}
    assert set(listed) == {p.name for p in out.iterdir()} - {"manifest.json"}
    for name, entry in listed.items():
        assert entry["sha256"] == sha256_file(out / name) and entry["size"] == (out / name).stat().st_size
    assert summary["sha256"] == manifest["sha256"] == folder_digest(out, exclude=("manifest.json",))[0][7:]
    assert summary["sizeBytes"] == sum(f["size"] for f in manifest["files"])

    v = manifest["validation"]
    assert v["passed"] and v["numPositions"] > 20
    assert 0 < v["maxAbsLogitDiff"] <= v["thresholds"]["maxAbsLogitDiff"]  # bf16 differs, within bounds
    assert v["top1Agreement"] >= validate.THRESHOLDS["bf16"].min_top1_agreement
    assert summary["validation"]["passed"] is True

    weights = tensors(out)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert leftovers(out.parent) == []


def test_int8_checkpoint_format(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "a100-int8"
    code, summary, _ = run_convert(
        capsys,
        "--source",
        str(tiny_model_dir),
        "--target",
        "nvidia-a100",
        "--dtype",
        "int8",
        "--out",
        str(out),
    )
    assert code == 0, summary
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "modelfleet",
        "format": "int8",
        "group": "per-channel",
    }
    assert config["torch_dtype"] == "bfloat16"  # the A100's serving dtype for everything not quantized
    weights, source = tensors(out), tensors(tiny_model_dir)
    q = weights["model.layers.1.mlp.down_proj.weight"]
    scale = weights["model.layers.1.mlp.down_proj.weight_scale"]
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (q.shape[0],)
    restored = q.float() * scale[:, None]
    original = source["model.layers.1.mlp.down_proj.weight"]
    assert (restored - original).abs().max() <= scale.max() / 2 + 1e-7
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings are not quantized
    assert "lm_head.weight_scale" not in weights
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["validation"]["method"] == "quantized-kernels"
    # judged against the source's bf16 model, measured in the same validation
    assert manifest["validation"]["rule"] == "relative-to-bf16"
    assert manifest["validation"]["baseline"]["dtype"] == "bf16"
    assert manifest["quantization"]["format"] == "int8"
    # Half the bytes of bf16 for every quantized matrix.
    assert (out / "model.safetensors").stat().st_size < (
        tiny_model_dir / "model.safetensors"
    ).stat().st_size / 2


def test_fp8_checkpoint_for_h100(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "h100-fp8"
    code, summary, _ = run_convert(
        capsys,
        "--source",
        str(tiny_model_dir),
        "--target",
        "nvidia-h100",
        "--dtype",
        "fp8",
        "--out",
        str(out),
    )
    assert code == 0, summary
    weights = tensors(out)
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "fp8"
    method = json.loads((out / "manifest.json").read_text())["validation"]["method"]
    assert method == ("quantized-kernels" if torch.cuda.is_available() else "dequantized-weights")


@pytest.mark.parametrize(
    ("target", "dtype", "message"),
    [
        ("cpu", "fp8", "dtype 'fp8' is not supported for torch on cpu; use one of: bf16, fp32, int8"),
        ("nvidia-t4", "bf16", "dtype 'bf16' is not supported for torch on nvidia-t4"),
    ],
)
def test_dtype_the_hardware_lacks_is_refused(tiny_model_dir, tmp_path, capsys, target, dtype, message):
    out = tmp_path / "x"
    code, summary, err = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", target, "--dtype", dtype, "--out", str(out)
    )
    assert code == 2 and summary["ok"] is False and message in summary["reason"]
    assert err.strip() == f"error: {summary['reason']}"
    assert not out.exists() and leftovers(tmp_path) == []


def broken_copies(tiny_model_dir: Path, root: Path) -> dict[str, tuple[Path, str]]:
    cases = {}

    def copy(name: str) -> Path:
        dst = root / name
        shutil.copytree(tiny_model_dir, dst)
        return dst

    (copy("no-config") / "config.json").unlink()
    cases["no-config"] = (root / "no-config", "has no config.json")
    (copy("bad-json") / "config.json").write_text("{not json")
    cases["bad-json"] = (root / "bad-json", "config.json is not valid JSON")
    arch = copy("arch")
    config = json.loads((arch / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (arch / "config.json").write_text(json.dumps(config))
    cases["arch"] = (arch, "architecture 'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM")
    truncated = copy("truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    cases["truncated"] = (root / "truncated", "model.safetensors is truncated or corrupt")
    return cases


def test_bad_sources_fail_in_one_line_and_publish_nothing(tiny_model_dir, tmp_path, capsys):
    for name, (source, message) in broken_copies(tiny_model_dir, tmp_path / "src").items():
        out = tmp_path / "out" / name
        code, summary, err = run_convert(
            capsys, "--source", source.as_uri(), "--target", "cpu", "--out", str(out)
        )
        assert code == 2, name
        assert message in summary["reason"], (name, summary["reason"])
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
        assert not out.exists()
    assert not (tmp_path / "out").exists()  # every check ran before anything was staged
    code, summary, _ = run_convert(
        capsys, "--source", str(tmp_path / "nope"), "--target", "cpu", "--out", str(out)
    )
    assert code == 2 and "does not exist" in summary["reason"]


def test_failed_validation_is_not_published(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # bf16 really differs from the float32 reference; a zero tolerance must reject it.
    monkeypatch.setitem(validate.THRESHOLDS, "bf16", validate.Thresholds(0.0, 1.0, 0.0))
    out = tmp_path / "strict"
    code, summary, err = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--out", str(out)
    )
    assert code == 4
    assert summary["ok"] is False and summary["validation"]["passed"] is False
    assert summary["reason"].startswith("validation failed for torch bf16: max |logit diff|")
    assert "validation failed" in err
    # the log carries the whole report, where the summary keeps a few figures
    line = next(x for x in err.splitlines() if x.startswith("validation report: "))
    report = json.loads(line.removeprefix("validation report: "))
    assert report["failures"] and report["thresholds"]["maxAbsLogitDiff"] == 0.0
    assert not out.exists() and leftovers(tmp_path) == []


def test_termination_log_and_rerun_is_idempotent(tiny_model_dir, tmp_path, capsys, monkeypatch):
    log = tmp_path / "termination-log"
    monkeypatch.setenv("MODELFLEET_TERMINATION_LOG", str(log))
    out = tmp_path / "fp32"
    args = ("--source", str(tiny_model_dir), "--target", "cpu", "--dtype", "fp32", "--out", str(out))
    code, first, _ = run_convert(capsys, *args)
    assert code == 0
    assert first["validation"]["maxAbsLogitDiff"] == 0.0 and first["validation"]["top1Agreement"] == 1.0
    written = log.read_text()
    assert json.loads(written) == first and len(written.encode()) < SUMMARY_LIMIT
    created = json.loads((out / "manifest.json").read_text())["createdAt"]

    code, again, err = run_convert(capsys, *args)  # a retried Job: same answer, nothing redone
    assert code == 0 and again["sha256"] == first["sha256"] and "already holds" in err
    assert json.loads((out / "manifest.json").read_text())["createdAt"] == created

    other = tmp_path / "other-dtype"
    other.mkdir()
    (other / "junk").write_text("x")
    code, refused, _ = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--out", str(other)
    )
    assert code == 2 and "is not empty" in refused["reason"] and "--force" in refused["reason"]
    code, _, _ = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--out", str(other), "--force"
    )
    assert code == 0 and not (other / "junk").exists() and (other / "manifest.json").exists()


def test_long_reason_keeps_summary_under_4k():
    from modelfleet.converters.artifact import summary, summary_line

    line = summary_line(summary(ok=False, target={"accelerator": "cpu"}, reason="x" * 10_000))
    assert len(line.encode()) < SUMMARY_LIMIT and json.loads(line)["accelerator"] == "cpu"


def test_tensorrt_missing_is_one_line_and_non_zero(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as on any host without TensorRT
    out = tmp_path / "trt"
    code, summary, err = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "nvidia-h100", "--format", "tensorrt",
        "--dtype", "fp16", "--out", str(out),
    )  # fmt: skip
    assert code == 3
    assert summary["reason"].startswith("TensorRT is not installed")
    assert err.strip() == f"error: {summary['reason']}"
    assert not out.exists() and leftovers(tmp_path) == []


def test_onnx_refuses_sliding_window_models(tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir, source)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out" / "onnx"
    code, summary, _ = run_convert(
        capsys, "--source", str(source), "--target", "cpu", "--format", "onnx", "--out", str(out)
    )
    assert (
        code == 2
        and "no sliding-window attention" in summary["reason"]
        and "--format torch" in summary["reason"]
    )
    assert not out.exists() and leftovers(out.parent) == []
