"""AsyncOnnxEngine: an ONNX artifact behind the torch engine's request loop.

The same LLMEngine and AsyncLLM as a torch checkpoint (scheduler and continuous batching, sampler, stop
checks, detokenizer, outputs), with `GraphRunner` (engine/graph_runner.py) running each step through
onnxruntime instead of the torch model. The graph keeps a contiguous cache per sequence, so there is
no prefix caching; the KV settings bound the tokens cached across sequences as on the torch engine.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.async_llm import AsyncLLM
from modelfleet.dataplane.engine.graph_runner import GraphRunner
from modelfleet.dataplane.engine.llm_engine import LLMEngine
from modelfleet.dataplane.onnx_runner import OnnxRunner


class AsyncOnnxEngine(AsyncLLM):
    """Takes the torch engine's settings (see EngineConfig) so one manifest can serve either format;
    prefix caching is always off, and `dtype`, `device` and `enforce_eager` are the graph's own."""

    runner_class: Any = OnnxRunner  # the TensorRT engine drives another runner with the same contract

    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        self.engine = graph_engine(model, self.runner_class, **engine_config)
        self._start("modelfleet-onnx-engine")


def graph_engine(model: str | Path, graph_class: Any, **engine_config: Any) -> LLMEngine:
    """An LLMEngine whose steps run on an exported graph (`graph_class(model_dir)`, see GraphRunner)."""
    config = EngineConfig.from_kwargs(model, **{**engine_config, "enable_prefix_caching": False})
    return LLMEngine(config, runner_class=functools.partial(GraphRunner, graph_class=graph_class))
