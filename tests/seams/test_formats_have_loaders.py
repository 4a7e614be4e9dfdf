"""Every artifact format the converters publish has a data-plane loader; a TensorRT artifact on a host
without TensorRT fails its load with the reason, in the loader and on the live server."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from modelfleet.converters import tensorrt_engine as trt_converter
from modelfleet.converters.formats import FORMATS
from modelfleet.dataplane.server import loading
from modelfleet.dataplane.server.model_manager import VersionSpec
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.dataplane.tensorrt_engine import TensorRTUnavailable

from .conftest import Server


def test_each_published_format_is_one_the_data_plane_loads(tmp_path):
    assert set(FORMATS) == set(loading.ARTIFACT_FORMATS)
    for fmt in FORMATS:
        artifact = tmp_path / fmt
        artifact.mkdir()
        (artifact / "manifest.json").write_text(json.dumps({"format": fmt}))
        assert loading.artifact_format(artifact) == fmt
    (tmp_path / "odd" / "manifest.json").parent.mkdir()
    (tmp_path / "odd" / "manifest.json").write_text(json.dumps({"format": "gguf"}))
    with pytest.raises(ValueError, match="format 'gguf' has no loader here"):
        loading.artifact_format(tmp_path / "odd")


def tensorrt_artifact(tiny_model_dir: Path, root: Path) -> Path:
    """The layout the converter publishes for a TensorRT target (its engine bytes are not run here)."""
    artifact = root / "nvidia-h100-tensorrt-fp16"
    artifact.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_model_dir / name).exists():
            shutil.copyfile(tiny_model_dir / name, artifact / name)
    (artifact / trt_converter.ENGINE_FILE).write_bytes(b"\0" * 64)
    (artifact / "manifest.json").write_text(json.dumps({"format": "tensorrt", "dtype": "fp16"}))
    return artifact


def test_tensorrt_artifact_without_tensorrt_fails_its_load_clearly(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as on any host without TensorRT
    artifact = tensorrt_artifact(tiny_model_dir, tmp_path)
    spec = VersionSpec("chat", "v1", str(artifact))
    with pytest.raises(TensorRTUnavailable, match="TensorRT is not installed"):
        loading.load_engine(spec)
    assert loading.estimate_engine_bytes(spec) >= 64

    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(
        "models:\n  - name: chat\n    versions:\n"
        f"      - {{name: v1, weight: 100, artifact: '{artifact}', preload: true}}\n"
    )
    server = Server(ServerSettings(), manifest)
    with pytest.raises(RuntimeError, match="did not become ready"):
        server.start(timeout=30)
    try:
        (version,) = httpx.get(f"{server.url}/ready").json()["versions"]
        assert version["state"] == "failed"
        assert version["error"].startswith("TensorRTUnavailable: TensorRT is not installed")
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "chat", "prompt": "hi"})
        assert answer.status_code == 503 and "TensorRT is not installed" in answer.text
    finally:
        server.stop()
