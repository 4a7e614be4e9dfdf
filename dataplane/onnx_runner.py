"""Serve an ONNX artifact (see converters/onnx_export.py for its inputs and outputs) with onnxruntime.

Its own simple KV cache: the graph returns each layer's keys and values for the whole sequence so far
(`present.*`), and the runner feeds them back as `past_key_values.*` on the next step. Batches are left
padded, so every sequence's newest token sits in the last column and one decode step serves them all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODEL_FILE = "model.onnx"


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"


class OnnxRunner:
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
        self.vocab_size = config["vocab_size"]
        eos = config.get("eos_token_id")
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_token_id = config.get("pad_token_id") or 0
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        self.session = ort.InferenceSession(
            str(path), options, providers=providers or ["CPUExecutionProvider"]
        )
        past_type = next(i.type for i in self.session.get_inputs() if i.name.startswith("past_key_values"))
        self.kv_dtype = np.float16 if "float16" in past_type else np.float32
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

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
        split = len(ids) // 2 if split is None else split
        arr = np.array([ids], dtype=np.int64)
        cache = self.empty_cache(1)
        outs = []
        for lo, hi in ((0, split), (split, len(ids))):
            if hi > lo:
                out, cache = self.forward(arr[:, lo:hi], np.ones((1, hi), dtype=np.int64), cache)
                outs.append(out[0])
        return np.concatenate(outs).astype(np.float32)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[Generation]:
        """Greedy (temperature 0) or sampled generation for a batch of prompts, in one batch."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        encoded = [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts]
        if any(not ids for ids in encoded):
            raise ValueError("every prompt needs at least one token")
        results = [Generation(prompt_token_ids=ids) for ids in encoded]
        rng = np.random.default_rng(seed)
        width = max(len(ids) for ids in encoded)
        input_ids = np.full((len(encoded), width), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(encoded), width), dtype=np.int64)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids) :] = ids
            mask[row, width - len(ids) :] = 1
        cache = self.empty_cache(len(encoded))
        active = np.ones(len(encoded), dtype=bool)
        for step in range(max_new_tokens):
            logits, cache = self.forward(input_ids, mask, cache)
            next_ids = self._sample(logits[:, -1].astype(np.float32), temperature, top_k, top_p, rng)
            for row, token in enumerate(next_ids.tolist()):
                if not active[row]:
                    continue
                results[row].token_ids.append(token)
                if token in self.eos_token_ids and not ignore_eos:
                    results[row].finish_reason, active[row] = "stop", False
                elif step == max_new_tokens - 1:
                    results[row].finish_reason = "length"
            if not active.any():
                break
            input_ids = next_ids[:, None].astype(np.int64)
            mask = np.concatenate([mask, active[:, None].astype(np.int64)], axis=1)
        if self._tokenizer is not None or any(isinstance(p, str) for p in prompts):
            for r in results:
                r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        return results

    @staticmethod
    def _sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng) -> np.ndarray:
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits / temperature
        if top_k > 0:
            kth = np.sort(logits, axis=-1)[:, -min(top_k, logits.shape[-1])][:, None]
            logits = np.where(logits < kth, -np.inf, logits)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        if top_p < 1:
            order = np.argsort(-probs, axis=-1)
            sorted_p = np.take_along_axis(probs, order, -1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = np.cumsum(sorted_p, -1) - sorted_p >= top_p
            sorted_p = np.where(drop, 0.0, sorted_p)
            probs = np.zeros_like(probs)
            np.put_along_axis(probs, order, sorted_p, -1)
            probs /= probs.sum(-1, keepdims=True)
        return np.array([rng.choice(len(p), p=p) for p in probs])
