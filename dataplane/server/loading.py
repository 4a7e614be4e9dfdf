"""The real version loader for the model manager: an `AsyncLLM` per version, sized for the memory budget."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.server.model_manager import VersionSpec

# transformers' lazy imports are not thread-safe, and two loads at once would only compete for the same
# memory bandwidth: load one version at a time.
_LOAD_LOCK = threading.Lock()


def engine_kwargs(spec: VersionSpec) -> dict[str, Any]:
    return {key: json.loads(value) for key, value in spec.engine_config}


def load_engine(spec: VersionSpec) -> Any:
    """Blocking: build the engine for one version (the manager runs this on a worker thread)."""
    from modelfleet.dataplane import AsyncLLM

    artifact = Path(spec.artifact)
    if not artifact.is_dir():
        raise FileNotFoundError(f"artifact {artifact} is not a directory")
    with _LOAD_LOCK:
        return AsyncLLM(str(artifact), **engine_kwargs(spec))


def estimate_engine_bytes(spec: VersionSpec) -> int:
    """Weights on disk plus the CPU KV-cache budget: what loading this version adds to memory."""
    artifact = Path(spec.artifact)
    weights = sum(p.stat().st_size for p in artifact.glob("*.safetensors")) if artifact.is_dir() else 0
    kv_bytes = engine_kwargs(spec).get("kv_cache_bytes", EngineConfig.kv_cache_bytes)
    return weights + int(kv_bytes)


def close_engine(engine: Any) -> None:
    engine.close()
