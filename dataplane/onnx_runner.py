"""Serve an ONNX artifact (see converters/onnx_export.py for its inputs and outputs) with onnxruntime.

Its own simple KV cache: the graph returns each layer's keys and values for the whole sequence so far
(`present.*`), and the runner feeds them back as `past_key_values.*` on the next step. The engine drives
it through engine/graph_runner.py, which batches sequences on this contract.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

MODEL_FILE = "model.onnx"


class OnnxRunner:
    device = "cpu"  # onnxruntime's CPU provider: the cache and the logits are host arrays

    def __init__(self, model_dir: str | Path, *, providers: list[str] | None = None, num_threads: int = 0):
        import onnxruntime as ort

        self.model_dir = Path(model_dir)
        path = self.model_dir / MODEL_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{self.model_dir} has no {MODEL_FILE}; give an ONNX artifact folder")
        config = json.loads((self.model_dir / "config.json").read_text())
        self.num_layers = config["num_hidden_layers"]
        self.num_kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
        self.head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        self.session = ort.InferenceSession(
            str(path), options, providers=providers or ["CPUExecutionProvider"]
        )
        past_type = next(i.type for i in self.session.get_inputs() if i.name.startswith("past_key_values"))
        self.kv_dtype = np.float16 if "float16" in past_type else np.float32

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        shape = (batch, self.num_kv_heads, 0, self.head_dim)
        return [np.zeros(shape, dtype=self.kv_dtype) for _ in range(2 * self.num_layers)]

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One step: logits [B, S, V] for the new tokens and the grown cache. `attention_mask` covers the
        cached tokens and the new ones ([B, past + S]); positions count real tokens only."""
        seq = input_ids.shape[1]
        positions = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None)[:, -seq:]
        feed = {
            "input_ids": input_ids.astype(np.int64),
            "attention_mask": attention_mask.astype(np.int64),
            "position_ids": positions.astype(np.int64),
        }
        for i in range(self.num_layers):
            feed[f"past_key_values.{i}.key"] = cache[2 * i]
            feed[f"past_key_values.{i}.value"] = cache[2 * i + 1]
        logits, *present = self.session.run(None, feed)
        return logits, present

    def logits(self, ids: list[int], split: int | None = None) -> np.ndarray:
        """Logits [T, V] of one sequence, computed in two steps (prefill of ids[:split], then the rest
        through the cache), so the cache path is exercised; float32."""
        return sequence_logits(self, ids, split)


def sequence_logits(graph: Any, ids: list[int], split: int | None) -> np.ndarray:
    """What a converter validates a graph runner with: `logits` of the ONNX and TensorRT runners."""
    split = len(ids) // 2 if split is None else split
    arr = np.array([ids], dtype=np.int64)
    cache = graph.empty_cache(1)
    outs = []
    for lo, hi in ((0, split), (split, len(ids))):
        if hi > lo:
            out, cache = graph.forward(arr[:, lo:hi], np.ones((1, hi), dtype=np.int64), cache)
            # a TensorRT runner's logits stay on the GPU for the sampler
            outs.append(out[0].float().cpu().numpy() if hasattr(out, "cpu") else out[0])
    return np.concatenate(outs).astype(np.float32)
