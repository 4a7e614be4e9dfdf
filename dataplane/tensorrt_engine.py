"""Serve a TensorRT artifact: a serialized engine (`model.plan`) built from the ONNX export, with the ONNX
graph's inputs and outputs (see onnx_runner.py), so the ONNX engine's request loop drives it unchanged:
batches up to the engine profile's batch size, sampling on the GPU.

Needs the `tensorrt` package and an NVIDIA GPU; where either is missing, loading fails with
`TensorRTUnavailable` naming what is missing (the version's /ready entry says so, requests get 503). The
engine's optimization profile bounds the batch and the context: `max_model_len` is capped to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from modelfleet.dataplane.onnx_engine import AsyncOnnxEngine
from modelfleet.dataplane.onnx_runner import sequence_logits

ENGINE_FILE = "model.plan"


class TensorRTUnavailable(RuntimeError):
    """This process cannot run TensorRT engines."""


def require_tensorrt() -> Any:
    """The tensorrt module, or TensorRTUnavailable naming what to install or where to run."""
    try:
        import tensorrt
    except ImportError:
        raise TensorRTUnavailable(
            "TensorRT is not installed: install the `tensorrt` package on a node with an NVIDIA GPU "
            "(a data-plane image with TensorRT), or use the torch or onnx artifact"
        ) from None
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("TensorRT needs an NVIDIA GPU and none is visible here; run on a GPU node")
    return tensorrt


class TensorRTRunner:
    """One engine and its execution context: OnnxRunner's `forward` contract, the cache and the logits
    kept on the GPU (where the sampler's kernel reads them)."""

    device = "cuda"

    def __init__(self, model_dir: str | Path) -> None:
        trt = require_tensorrt()
        import torch

        self.model_dir = Path(model_dir)
        path = self.model_dir / ENGINE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{self.model_dir} has no {ENGINE_FILE}; give a TensorRT artifact folder")
        config = json.loads((self.model_dir / "config.json").read_text())
        self.num_layers = config["num_hidden_layers"]
        self.num_kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise RuntimeError(
                f"{path}: TensorRT cannot load this engine (built for another GPU or TensorRT version); "
                "convert the version again on this hardware"
            )
        self.context = self.engine.create_execution_context()
        _, _, largest = self.engine.get_tensor_profile_shape("attention_mask", 0)
        self.max_batch, self.max_tokens = int(largest[0]), int(largest[1])
        self._torch = torch
        self._dtypes = {
            trt.float32: torch.float32,
            trt.float16: torch.float16,
            trt.bfloat16: torch.bfloat16,
            trt.int64: torch.int64,
            trt.int32: torch.int32,
        }

    def _dtype(self, name: str):
        return self._dtypes[self.engine.get_tensor_dtype(name)]

    def empty_cache(self, batch: int) -> list[Any]:
        torch = self._torch
        dtype = self._dtype("past_key_values.0.key")
        shape = (batch, self.num_kv_heads, 0, self.head_dim)
        return [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(2 * self.num_layers)]

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: list[Any]
    ) -> tuple[Any, list]:
        """One step: logits [B, S, V] and the grown cache, both on the GPU."""
        torch = self._torch
        seq = input_ids.shape[1]
        positions = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None)[:, -seq:]
        feeds = {
            "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids)),
            "attention_mask": torch.from_numpy(np.ascontiguousarray(attention_mask)),
            "position_ids": torch.from_numpy(np.ascontiguousarray(positions)),
        }
        for i in range(self.num_layers):
            feeds[f"past_key_values.{i}.key"] = cache[2 * i]
            feeds[f"past_key_values.{i}.value"] = cache[2 * i + 1]
        inputs = {}  # kept alive until the step has run
        for name, tensor in feeds.items():
            inputs[name] = tensor.to("cuda", self._dtype(name)).contiguous()
            self.context.set_input_shape(name, tuple(inputs[name].shape))
            self.context.set_tensor_address(name, inputs[name].data_ptr())
        names = ["logits"] + [
            f"present.{i}.{kind}" for i in range(self.num_layers) for kind in ("key", "value")
        ]
        outputs = {}
        for name in names:
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self._dtype(name), device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("the TensorRT engine failed to run a step")
        stream.synchronize()
        return outputs["logits"], [outputs[name] for name in names[1:]]

    def logits(self, ids: list[int], split: int | None = None) -> np.ndarray:
        """Logits [T, V] of one sequence (float32, on the host): a prefill of ids[:split], then the rest
        through the cache."""
        return sequence_logits(self, ids, split)


class AsyncTensorRTEngine(AsyncOnnxEngine):
    """The engine's request loop (engine/graph_runner.py) over a TensorRT runner."""

    runner_class = TensorRTRunner
