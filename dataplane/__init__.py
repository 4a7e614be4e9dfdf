"""Data plane: the engine and the model server.

The public names below are imported on first use, so `import modelfleet.dataplane` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "modelfleet.dataplane.llm",
    "AsyncLLM": "modelfleet.dataplane.engine.async_llm",
    "SamplingParams": "modelfleet.dataplane.sampling_params",
    "EngineConfig": "modelfleet.dataplane.config",
    "RequestOutput": "modelfleet.dataplane.engine.outputs",
    "EngineStats": "modelfleet.dataplane.engine.outputs",
}

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from modelfleet.dataplane.config import EngineConfig
    from modelfleet.dataplane.engine.async_llm import AsyncLLM
    from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
    from modelfleet.dataplane.llm import LLM
    from modelfleet.dataplane.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'modelfleet.dataplane' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
