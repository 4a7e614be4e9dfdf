"""The real version loader for the model manager: an engine per version, sized for the memory budget.

A torch checkpoint (safetensors) gets an `AsyncLLM`, or on a GPU an `AsyncLLMProcess` (the engine loop
in its own process, so that the server's event loop never holds up a step); an ONNX artifact
(manifest.json says format "onnx", or *.onnx files without safetensors) gets an `AsyncOnnxEngine`; a
TensorRT artifact (format "tensorrt", or a model.plan) an `AsyncTensorRTEngine`, whose load fails with
the reason where the image has no TensorRT or the node no NVIDIA GPU. Every format the converters
publish has its loader here.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.protocol import Engine
from modelfleet.dataplane.server.model_manager import VersionSpec

# transformers' lazy imports are not thread-safe, and two loads at once would only compete for the same
# memory bandwidth: load one version at a time.
_LOAD_LOCK = threading.Lock()


def engine_kwargs(spec: VersionSpec) -> dict[str, Any]:
    return {key: json.loads(value) for key, value in spec.engine_config}


def spec_max_num_seqs(spec: VersionSpec) -> int:
    """Sequences the version's engine will run at once, before it is built (a loaded engine says so
    itself: `Engine.limits`)."""
    value = engine_kwargs(spec).get("max_num_seqs", EngineConfig.max_num_seqs)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


ARTIFACT_FORMATS = ("torch", "onnx", "tensorrt")


def artifact_format(artifact: Path) -> str:
    """torch, onnx or tensorrt: what the artifact's manifest.json says, else what its files are."""
    manifest = artifact / "manifest.json"
    if manifest.is_file():
        try:
            fmt = json.loads(manifest.read_text()).get("format")
        except (ValueError, AttributeError):
            fmt = None
        if fmt is not None:
            if fmt not in ARTIFACT_FORMATS:
                raise ValueError(
                    f"{manifest}: format {fmt!r} has no loader here; one of {', '.join(ARTIFACT_FORMATS)}"
                )
            return fmt
    if any(artifact.glob("*.safetensors")):
        return "torch"
    if any(artifact.glob("*.plan")):
        return "tensorrt"
    return "onnx" if any(artifact.glob("*.onnx")) else "torch"


def is_onnx_artifact(artifact: Path) -> bool:
    return artifact_format(artifact) == "onnx"


# Streams one relay process keeps up with. H100 host, 1B preset, 128/128 (bench/serve.py): at 256 streams
# two relays (128 streams each) paced the engine at 0.57x its rate alone, four (64 each) at 0.87x.
STREAMS_PER_RELAY = 64


def relays_for(spec: VersionSpec) -> int:
    """Stream relays for a version's engine process when the server names no count: one per
    STREAMS_PER_RELAY sequences it runs at once."""
    return -(-spec_max_num_seqs(spec) // STREAMS_PER_RELAY)


def load_engine(spec: VersionSpec, *, stream_relays: int | None = None, send_timeout: float = 30.0) -> Engine:
    """Blocking: build the engine for one version (the manager runs this on a worker thread). An engine
    in its own process gets `stream_relays` relays writing its streams (None: relays_for the version),
    with a deadline of `send_timeout` per write."""
    artifact = Path(spec.artifact)
    if not artifact.is_dir():
        raise FileNotFoundError(f"artifact {artifact} is not a directory")
    with _LOAD_LOCK:
        fmt = artifact_format(artifact)
        if fmt == "onnx":
            from modelfleet.dataplane.onnx_engine import AsyncOnnxEngine

            return AsyncOnnxEngine(str(artifact), **engine_kwargs(spec))
        if fmt == "tensorrt":
            from modelfleet.dataplane.tensorrt_engine import AsyncTensorRTEngine

            return AsyncTensorRTEngine(str(artifact), **engine_kwargs(spec))
        kwargs = engine_kwargs(spec)
        if engine_in_own_process(kwargs.get("device"), torch_cuda_available()):
            from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess

            relays = relays_for(spec) if stream_relays is None else stream_relays
            return AsyncLLMProcess(str(artifact), stream_relays=relays, send_timeout=send_timeout, **kwargs)
        from modelfleet.dataplane import AsyncLLM

        return AsyncLLM(str(artifact), **kwargs)


def engine_in_own_process(device: Any, cuda_available: bool) -> bool:
    """GPU engines step in their own process: there a step is a few milliseconds, and sharing the
    interpreter lock with the HTTP event loop (tens of microseconds per streamed token) would leave
    the GPU waiting. A CPU engine's step is long and mostly outside the lock: it stays a thread. (Not
    `device.resolve_device`: that would open a CUDA context in the server process, which needs none.)"""
    if device is None or device == "auto":
        return cuda_available
    return str(device).split(":")[0] == "cuda"  # ROCm GPUs are torch "cuda" devices too


def torch_cuda_available() -> bool:
    """Whether torch sees a GPU, without initializing the CUDA driver in this process: device_count asks
    NVML, where is_available calls cuInit. Under MPS (gpu_sharing.py) an initialized driver makes the
    server a client of the daemon it started, for as long as it lives: told to quit at shutdown, the
    daemon waited for the server itself (30 s, then its folders were left behind, and it ran on)."""
    import torch

    return torch.cuda.device_count() > 0


def estimate_engine_bytes(spec: VersionSpec) -> int:
    """Weights on disk plus the KV cache: what loading this version adds to memory. An ONNX engine's
    caches grow with its running requests, at most max_num_seqs of max_model_len tokens within the KV
    budget; its weights are the graph and its external data files."""
    artifact = Path(spec.artifact)
    if not artifact.is_dir():
        return 0
    kwargs = engine_kwargs(spec)
    try:
        fmt = artifact_format(artifact)
    except ValueError:
        return 0  # the load itself will say what is wrong with the artifact
    kv_bytes = int(kwargs.get("kv_cache_bytes", EngineConfig.kv_cache_bytes))
    if fmt in ("onnx", "tensorrt"):
        # The graphs and their external data (model.onnx.data, or any *.data), or the TensorRT plan.
        patterns = ("*.onnx", "*.onnx.data", "*.data", "*.plan")
        files = {p for pattern in patterns for p in artifact.glob(pattern)}
        weights = sum(p.stat().st_size for p in files if p.is_file())
        per_seq = _onnx_cache_bytes(artifact, kwargs.get("max_model_len"))
        return weights + min(kv_bytes, per_seq * spec_max_num_seqs(spec))
    weights = sum(p.stat().st_size for p in artifact.glob("*.safetensors"))
    return weights + kv_bytes + int(kwargs.get("host_kv_cache_bytes", 0))  # and the host KV tier's pool


def _onnx_cache_bytes(artifact: Path, max_model_len: Any) -> int:
    """Keys and values of every layer for one sequence of max_model_len tokens (float32 at most)."""
    try:
        config = json.loads((artifact / "config.json").read_text())
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        tokens = max_model_len if isinstance(max_model_len, int) else config.get("max_position_embeddings", 0)
        return 2 * config["num_hidden_layers"] * heads * head_dim * int(tokens) * 4
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # the load itself will say what is wrong with the artifact


def close_engine(engine: Engine) -> None:
    engine.close()
