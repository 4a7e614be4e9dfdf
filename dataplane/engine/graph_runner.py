"""Runs the scheduler's steps on an exported graph (ONNX through onnxruntime, a TensorRT engine), so that
those formats share the torch engine's request loop: scheduler, sampler, stop checks, detokenizer and
outputs. Only the forward differs.

An exported graph takes its KV cache as one contiguous tensor per layer (`past_key_values.*`) and
returns it grown (`present.*`); it cannot read paged blocks. So each sequence keeps its own cache here,
and the block manager only accounts for it: the blocks bound the tokens cached across sequences (the
KV budget, as on the torch engine) but hold nothing, and prefix caching is off (a hit would name
blocks whose keys and values live in another sequence's cache). Sharing blocks would take a graph that
reads a block table, which is what the torch models do.

Sequences with the same number of new tokens run as one batch: their caches are stacked, shorter ones
padded on the left with masked positions (the graph takes the attention mask), and split again after.
The forward is synchronous, so a step's tokens are known when `launch` returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.model_runner import LaunchedStep
from modelfleet.dataplane.engine.sampler import Sampler
from modelfleet.dataplane.engine.scheduler import ScheduledSequence, SchedulerOutput
from modelfleet.dataplane.engine.sequence import Sequence, SequenceStatus

Cache = list[Any]  # one [batch, kv_heads, tokens, head_dim] array (numpy or torch) per key and value


class GraphRunner:
    """The model runner's contract (see ModelRunner) over a graph runner: `graph_class(model_dir)` with
    `forward(input_ids, attention_mask, cache) -> (logits [B, S, V], cache)`, `empty_cache(batch)`,
    `num_layers`, `num_kv_heads`, `head_dim`, `device`, and optionally `max_batch` and `max_tokens`
    (the bounds of a TensorRT engine's profile)."""

    def __init__(
        self, config: EngineConfig, max_model_len: int, *, graph_class: Callable[[str], Any]
    ) -> None:
        from modelfleet.dataplane.models.config import ModelConfig

        if config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: an exported graph keeps each sequence's cache apart")
        if config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: an exported graph runs whole, on one device")
        if config.kv_cache_dtype != "auto":
            raise ValueError("kv_cache_dtype: an exported graph keeps its cache in its own dtype; use auto")
        self.graph = graph_class(config.model)
        self.model_config = ModelConfig.from_dir(config.model)
        self.device = torch.device(self.graph.device)
        self.max_model_len = _graph_max_model_len(self.graph, config, max_model_len)
        self.max_batch: int = getattr(self.graph, "max_batch", None) or config.max_num_seqs
        self.block_bytes = (
            2 * self.graph.num_layers * config.block_size * self.graph.num_kv_heads * self.graph.head_dim
        ) * _itemsize(self.graph.empty_cache(1)[0])
        budget = _kv_budget(config, self.device)
        max_useful = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        self.num_blocks = min(budget // self.block_bytes, max_useful)
        if self.num_blocks < 1:
            field = "kv_cache_bytes" if self.device.type == "cpu" else "kv_cache_memory_fraction"
            raise ValueError(
                f"{field}: the KV-cache budget of {budget} bytes holds no block of {self.block_bytes} bytes; "
                "raise it"
            )
        self.sampler = Sampler(self.device, seed=config.seed)
        # Each running sequence's cache; a sequence that is gone takes its entry with it.
        self._caches: weakref.WeakKeyDictionary[Sequence, Cache] = weakref.WeakKeyDictionary()
        # The latest step's sampled tokens, by sampling row: the next step's tokens in flight.
        self._sampled_ids: torch.Tensor | None = None

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, end_previous: Callable[[], None] | None = None) -> LaunchedStep:
        """Runs the step's forward and queues its sampling, the step before ended first (ModelRunner's)."""
        if end_previous is not None:
            end_previous()
        scheduled = out.scheduled
        self._drop_stale_caches()
        # Read back once, and only when a sequence's input is a token still in flight.
        waits = any(item.num_computed_tokens >= len(item.seq.token_ids) for item in scheduled)
        inflight = self._sampled_ids.tolist() if waits and self._sampled_ids is not None else []
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(scheduled):
            groups.setdefault(item.num_new_tokens, []).append(i)
        last_logits: dict[int, Any] = {}
        for indices in groups.values():
            for start in range(0, len(indices), self.max_batch):
                part = indices[start : start + self.max_batch]
                logits = self._forward([scheduled[i] for i in part], inflight)
                for row, i in enumerate(part):
                    if scheduled[i].samples:
                        last_logits[i] = logits[row, -1]
        sampling_rows = [i for i, item in enumerate(scheduled) if item.samples]
        if not sampling_rows:
            return LaunchedStep(len(scheduled), sampling_rows, None)
        rows = [last_logits[i] for i in sampling_rows]
        logits = torch.stack(rows) if isinstance(rows[0], torch.Tensor) else torch.from_numpy(np.stack(rows))
        seqs = [scheduled[i].seq for i in sampling_rows]
        sampled = self.sampler.sample(logits.to(self.device), seqs)
        self._sampled_ids = sampled.token_ids
        for row, seq in enumerate(seqs):
            seq.sample_row = row
        return LaunchedStep(len(scheduled), sampling_rows, sampled)

    def _drop_stale_caches(self) -> None:
        """A finished sequence's cache goes at once rather than when the sequence is collected; a
        preempted one's too (it is recomputed from its tokens)."""
        for seq in [s for s in self._caches if s.status is not SequenceStatus.RUNNING]:
            del self._caches[seq]

    def _forward(self, items: list[ScheduledSequence], inflight: list[int]) -> Any:
        """One graph call for sequences with the same number of new tokens; logits [B, S, V]."""
        graph = self.graph
        past_lens = [item.num_computed_tokens for item in items]
        width = max(past_lens)
        new = items[0].num_new_tokens
        input_ids = np.empty((len(items), new), dtype=np.int64)
        mask = np.zeros((len(items), width + new), dtype=np.int64)
        caches = []
        for row, item in enumerate(items):
            seq, start = item.seq, item.num_computed_tokens
            if start >= len(seq.token_ids):  # the token sampled by the step before, not yet on the host
                input_ids[row] = inflight[seq.sample_row]
            else:
                input_ids[row] = seq.token_ids[start : start + new]
            mask[row, width - start :] = 1
            cache = self._caches.get(seq) if start else None
            if cache is None:
                cache = graph.empty_cache(1)
            if _cached_tokens(cache) != start:
                raise RuntimeError(
                    f"{seq.request_id}: {_cached_tokens(cache)} tokens cached, {start} expected"
                )
            caches.append(cache)
        if len(items) == 1:
            batch_cache = caches[0]
        else:
            batch_cache = [_stack_left_padded([c[k] for c in caches], width) for k in range(len(caches[0]))]
        logits, present = graph.forward(input_ids, mask, batch_cache)
        for row, (item, start) in enumerate(zip(items, past_lens, strict=True)):
            pad = width - start
            self._caches[item.seq] = [layer[row : row + 1, :, pad:] for layer in present]
        return logits


def _graph_max_model_len(graph: Any, config: EngineConfig, max_model_len: int) -> int:
    """max_model_len, lowered to the tokens the graph's profile takes (a TensorRT engine's)."""
    limit = getattr(graph, "max_tokens", None)
    if limit is None or max_model_len <= limit:
        return max_model_len
    if config.max_model_len is not None:
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the {limit} tokens this engine was built for; "
            "lower it"
        )
    return limit


def _kv_budget(config: EngineConfig, device: torch.device) -> int:
    """The byte budget on the CPU, a share of what the weights left free on accelerators."""
    if device.type == "cpu":
        return config.kv_cache_bytes
    from modelfleet.dataplane.device import memory_info

    return int(memory_info(device).free_bytes * config.kv_cache_memory_fraction)


def _itemsize(array: Any) -> int:
    return array.element_size() if isinstance(array, torch.Tensor) else array.itemsize


def _cached_tokens(cache: Cache) -> int:
    return cache[0].shape[2]


def _stack_left_padded(parts: list[Any], width: int) -> Any:
    """[1, H, n_i, D] caches of one layer -> [B, H, width, D], each at the right end after zeros (the
    masked positions)."""
    first = parts[0]
    shape = (len(parts), first.shape[1], width, first.shape[3])
    out = first.new_zeros(shape) if isinstance(first, torch.Tensor) else np.zeros(shape, dtype=first.dtype)
    for row, part in enumerate(parts):
        length = part.shape[2]
        if length:
            out[row, :, width - length :] = part[0]
    return out
