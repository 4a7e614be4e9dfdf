"""AsyncOnnxEngine: an ONNX artifact behind the same surface the server uses from AsyncLLM.

Requests run one at a time on a worker thread through `OnnxRunner`, each with its own contiguous KV
cache that grows by one token per step: there is no paging, no prefix caching and no continuous
batching, so waiting requests queue (lowest priority value first, then arrival order) until the
running one ends. Sampling follows the torch engine's `SamplingParams` with numpy.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.detokenizer import IncrementalDetokenizer
from modelfleet.dataplane.engine.llm_engine import Prompt, PromptChecks, load_tokenizer
from modelfleet.dataplane.engine.outputs import EngineStats, request_output
from modelfleet.dataplane.engine.threaded import ThreadedEngine
from modelfleet.dataplane.onnx_runner import OnnxRunner
from modelfleet.dataplane.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    rng: np.random.Generator
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    num_reported: int = 0
    first_token_time: float | None = None
    aborted: bool = False


class AsyncOnnxEngine(PromptChecks, ThreadedEngine):
    """Takes the torch engine's settings (see EngineConfig) so one manifest can serve either format;
    only `max_model_len` and `seed` mean something here, the paged-cache ones are accepted and unused."""

    runner_class: Any = OnnxRunner  # the TensorRT engine drives another runner with the same contract

    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        from transformers import AutoTokenizer

        self.config = EngineConfig.from_kwargs(model, **engine_config)
        self.runner = self.runner_class(self.config.model)
        model_config = json.loads((Path(self.config.model) / "config.json").read_text())
        model_max = model_config.get("max_position_embeddings") or 2048
        if self.config.max_model_len is not None and self.config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len: {self.config.max_model_len} exceeds the model's maximum length {model_max}"
            )
        self.max_model_len: int = self.config.max_model_len or model_max
        self.tokenizer = load_tokenizer(AutoTokenizer, self.config.model)
        self.vocab_size: int = self.runner.vocab_size
        eos = set(self.runner.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # Noise for requests without a seed of their own.
        self._rng = np.random.default_rng(self.config.seed)
        self._tokenizer_lock = threading.Lock()

        self._waiting: list[tuple[int, int, _Request]] = []  # heap of (priority, arrival order, request)
        self._order = itertools.count()
        self._running: _Request | None = None
        self._cached_tokens = 0
        self._start("modelfleet-onnx-engine")

    # --- the caller's side (event loop); the checks are PromptChecks' ---

    def _add_command(
        self, request_id: str, prompt: Prompt, priority: int, validated: tuple[list[int], SamplingParams]
    ) -> tuple:
        token_ids, params = validated
        request = _Request(
            request_id,
            token_ids,
            params,
            IncrementalDetokenizer(self.tokenizer, token_ids, params.stop),
            np.random.default_rng(params.seed) if params.seed is not None else self._rng,
            arrival_time=time.monotonic(),
            logprobs=[] if params.logprobs is not None else None,
        )
        return ("add", request, priority)

    def stats(self) -> EngineStats:
        # No blocks: one contiguous cache for the running request, at most max_model_len tokens.
        return EngineStats(
            num_running=1 if self._running is not None else 0,
            num_waiting=len(self._waiting),
            kv_cache_usage=min(self._cached_tokens / self.max_model_len, 1.0),
            prefix_cache_hit_rate=0.0,
            num_free_blocks=0,
            num_total_blocks=0,
        )

    # --- the worker thread ---

    def _run(self) -> None:
        while not self._closed:
            self._apply_commands()
            if not self._waiting:
                self._wake.wait()
                self._wake.clear()
                continue
            _, _, request = heapq.heappop(self._waiting)
            self._running = request
            try:
                self._serve(request)
            except Exception as exc:  # this request fails alone; the next one starts clean
                logger.exception("request %s failed", request.request_id)
                self._finish(request, "error", error=f"onnxruntime failed: {exc}")
            finally:
                self._running, self._cached_tokens = None, 0
        # Closed: nothing will answer the requests still in flight, so end their streams loudly.
        self._commands.clear()
        for request_id in list(self._streams):
            self._deliver(request_id, RuntimeError("AsyncOnnxEngine was closed"))

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, request, priority = command
                if request.request_id in self._streams:  # else cancelled before it was added
                    heapq.heappush(self._waiting, (priority, next(self._order), request))
                continue
            request_id = command[1]
            if self._running is not None and self._running.request_id == request_id:
                self._running.aborted = True
                continue
            for index, (_, _, waiting) in enumerate(self._waiting):
                if waiting.request_id == request_id:
                    self._waiting.pop(index)
                    heapq.heapify(self._waiting)
                    self._finish(waiting, "abort")
                    break

    def _serve(self, request: _Request) -> None:
        """Prefill, then one decode step per token, until a stop condition or an abort."""
        runner = self.runner
        ids = np.array([request.prompt_token_ids], dtype=np.int64)
        cache = runner.empty_cache(1)
        length = 0
        while True:
            length += ids.shape[1]
            logits, cache = runner.forward(ids, np.ones((1, length), dtype=np.int64), cache)
            self._cached_tokens = length
            row = logits[0, -1].astype(np.float32)
            if np.isnan(row).any():
                self._finish(request, "error", error="the model produced NaN logits")
                return
            token = self._sample(row, request)
            request.token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            reason = self._stop_reason(request, token)
            new_text, stopped = request.detokenizer.add_tokens([token], finished=reason is not None)
            self._apply_commands()  # an abort or a closed stream ends the request before the next token
            if stopped or reason is not None:
                self._finish(request, "stop" if stopped else reason, new_text)
                return
            if request.aborted or request.request_id not in self._streams:
                self._finish(request, "abort", new_text)
                return
            self._emit(request, new_text)
            if self._closed:
                return
            ids = np.array([[token]], dtype=np.int64)

    def _stop_reason(self, request: _Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        total = len(request.prompt_token_ids) + len(request.token_ids)
        if len(request.token_ids) >= params.max_tokens or total >= self.max_model_len:
            return "length"
        return None

    def _sample(self, logits: np.ndarray, request: _Request) -> int:
        params = request.params
        if request.logprobs is not None:
            raw = _log_softmax(logits)
        if params.has_penalties:
            logits = _apply_penalties(logits, request)
        token = int(logits.argmax()) if params.greedy else _sample_token(logits, params, request.rng)
        if request.logprobs is not None:
            top = np.argsort(-raw)[: params.logprobs] if params.logprobs else np.array([], dtype=np.int64)
            entry = {int(t): float(raw[t]) for t in top}
            entry[token] = float(raw[token])
            request.logprobs.append(entry)
        return token

    def _emit(
        self, request: _Request, new_text: str, finish_reason: str | None = None, error: str | None = None
    ) -> None:
        delta = request.params.output_kind == "delta"
        if not delta:
            request.text += new_text
        new_token_ids = request.token_ids[request.num_reported :]
        request.num_reported = len(request.token_ids)
        finished = finish_reason is not None
        output = request_output(
            delta=delta,
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            text=request.text,
            token_ids=request.token_ids,
            new_text=new_text,
            new_token_ids=new_token_ids,
            logprobs=request.logprobs,
            finish_reason=finish_reason,
            finished=finished,
            error=error,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finished_time=time.monotonic() if finished else None,
        )
        self._deliver(request.request_id, output)

    def _finish(
        self, request: _Request, reason: str, new_text: str = "", *, error: str | None = None
    ) -> None:
        if request is self._running:  # stats() already shows it gone when its caller sees the end
            self._running, self._cached_tokens = None, 0
        self._emit(request, new_text, reason, error)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def _apply_penalties(logits: np.ndarray, request: _Request) -> np.ndarray:
    """As the torch engine: repetition penalty over prompt and output, presence and frequency penalties
    over the output only."""
    params = request.params
    logits = logits.copy()
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.array(request.prompt_token_ids + request.token_ids, dtype=np.int64))
        values = logits[seen]
        logits[seen] = np.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if (params.presence_penalty or params.frequency_penalty) and request.token_ids:
        counts = np.bincount(np.array(request.token_ids), minlength=logits.shape[0]).astype(np.float32)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def _sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    logits = logits / params.temperature
    if params.top_k_enabled and params.top_k < logits.shape[0]:
        kth = np.partition(logits, -params.top_k)[-params.top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        sorted_p = probs[order]
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
        drop = np.cumsum(sorted_p) - sorted_p >= params.top_p
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs = np.where(probs < probs.max() * params.min_p, 0.0, probs)
    probs /= probs.sum()
    return int(rng.choice(probs.shape[0], p=probs))
