"""Structured output: a request's JSON schema (or "any JSON object") compiled by xgrammar into a grammar
whose matcher, one per sequence, masks the logits of every step to the tokens that keep the output
valid. The matcher follows the sampled tokens just before it masks (below), so constrained sequences
keep the engine's overlap; once the JSON is complete only end-of-sequence tokens remain allowed.

Where the work happens:
- `check_structured`, on the caller's side (PromptChecks.validate): the schema is parsed into a grammar
  (no tokenizer, fast), so a bad schema is refused (a 400) before anything is queued.
- `Grammars.compile`, on a worker thread: the grammar's token masks over the whole vocabulary (the
  slow part) are built there, once per schema (cached), while the engine thread keeps stepping the
  other requests; a request joins the scheduler once its grammar is ready.
- `GrammarMasks.apply`, in the sampler, once per step for all constrained rows: each matcher first
  accepts the tokens sampled since it last masked (the previous step's token is read back from that
  step alone, so the engine keeps launching a step before reading the one before: the forward of step
  n+1 runs on the device while the host waits for step n's tokens and fills n+1's masks); then one
  batched fill of a reused bitmask, one copy of it to the device and one masking kernel.

xgrammar is imported on first use: an engine that never sees a constrained request never loads it."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from modelfleet.dataplane.engine.sampler import SampledBatch
    from modelfleet.dataplane.engine.sequence import Sequence
    from modelfleet.dataplane.sampling_params import SamplingParams

KINDS = ("json_object", "json_schema")
# json_object is OpenAI's "any JSON object" (not an array or a bare value).
ANY_OBJECT = '{"type": "object"}'
# Compiled grammars kept for reuse, by (kind, schema); the oldest used goes first.
CACHE_SIZE = 256


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "response_format: structured output needs xgrammar, which is not installed"
        ) from None
    return xgrammar


def _schema(structured: tuple[str, str]) -> str:
    kind, schema = structured
    return ANY_OBJECT if kind == "json_object" else schema


def check_structured(structured: tuple[str, str], tokenizer: Any) -> None:
    """ValueError naming what is wrong with a request's constraint; parses the schema, compiles nothing."""
    if tokenizer is None:
        raise ValueError("response_format: structured output needs the model's tokenizer")
    xgrammar = _xgrammar()
    try:
        # Compact JSON: free whitespace would let a model spend its tokens on spaces.
        xgrammar.Grammar.from_json_schema(_schema(structured), any_whitespace=False)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its own message
        raise ValueError(f"response_format: the JSON schema cannot be compiled: {exc}") from None


class Grammars:
    """Compiles the grammars of one engine's tokenizer on a worker thread, one compile per schema."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], cache_size: int = CACHE_SIZE
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        # One worker: compiles use every core xgrammar is given already; more would only contend.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modelfleet-grammar")

    def compile(self, structured: tuple[str, str]) -> Future[Any]:
        """The compiled grammar, made (or being made) on the worker; it fails with ValueError."""
        with self._lock:
            future = self._compiled.get(structured)
            if future is not None and not future.cancelled():
                self._compiled.move_to_end(structured)
                return future
            future = self._pool.submit(self._compile, structured)
            self._compiled[structured] = future
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
            return future

    def _compile(self, structured: tuple[str, str]) -> Any:
        compiler = self._compiler or self._make_compiler()
        try:
            return compiler.compile_json_schema(_schema(structured), any_whitespace=False)
        except Exception as exc:
            raise ValueError(f"response_format: the JSON schema cannot be compiled: {exc}") from None

    @staticmethod
    def matcher(compiled: Any, params: SamplingParams) -> SequenceGrammar:
        """A fresh matcher for one sequence, from a compiled grammar (cheap: on the engine thread)."""
        import xgrammar

        return SequenceGrammar(xgrammar.GrammarMatcher(compiled), params)

    def _make_compiler(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("response_format: structured output needs the model's tokenizer")
        xgrammar = _xgrammar()
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceGrammar:
    """One sequence's matcher and how many of its output tokens it has accepted (it follows the tokens
    when its sequence next samples, so tokens still in flight need no wait before that)."""

    __slots__ = ("matcher", "num_accepted", "temperature_only")

    def __init__(self, matcher: Any, params: SamplingParams) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        # Sampling needs nothing but a temperature once the mask is applied: the fused sampler's rows.
        self.temperature_only = dataclasses.replace(params, structured=None).temperature_only


# Rows of bitmask kept for reuse, at least; the buffers grow with the batch.
MIN_ROWS = 64
# Threads filling one step's bitmask rows: xgrammar's "auto" (half the cores) unless set to a number.
FILL_THREADS_ENV = "MODELFLEET_GRAMMAR_THREADS"


def fill_threads() -> int | str:
    """The environment's thread count for GrammarMasks; read when a sampler is made, so that a bad value
    stops the engine at its start rather than failing a batch."""
    value = os.environ.get(FILL_THREADS_ENV, "auto").strip()
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{FILL_THREADS_ENV}: {value!r} must be 'auto' or a number of threads >= 1")
    return int(value)


class GrammarMasks:
    """A sampler's grammar work for each step, for all its constrained rows at once (see the module's
    docstring). The bitmask lives in one host buffer (pinned for a device) reused every step, and its
    device copy in one device buffer; an event guards the host buffer until its copy has run."""

    def __init__(self, threads: int | str = "auto") -> None:
        xgrammar = _xgrammar()
        self._xgrammar = xgrammar
        # xgrammar's pool, which fills the rows of one step in parallel (threads: see fill_threads).
        self._filler = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._copied: Any = None  # a CUDA event once a copy was queued

    def apply(
        self, logits: torch.Tensor, seqs: list[Sequence], previous: SampledBatch | None
    ) -> torch.Tensor:
        """Masks, in place, each constrained row's logits to what its grammar allows next. `previous`:
        the sampler's batch before this one, which holds any token still in flight of these rows."""
        # A terminated matcher (it has accepted its end) has no next token to allow; its sequence is
        # ending, and this row's token is dropped.
        live = [(i, m) for i, m in _follow_tokens(seqs, previous) if not m.is_terminated()]
        if not live:
            return logits
        rows = [i for i, _ in live]
        num_rows, vocab = logits.shape
        host = self._host_buffer(num_rows, vocab, logits.device)
        self._filler.batch_fill_next_token_bitmask([m for _, m in live], host, indices=rows)
        logits = logits.contiguous()
        bitmask = host[:num_rows]
        if logits.device.type != "cpu":
            assert self._device is not None  # made with the pinned host buffer
            bitmask = self._device[:num_rows].copy_(bitmask, non_blocking=True)
            self._copied.record()
        # Every row constrained (the usual batch of one schema): no indices to send along.
        indices = None if len(rows) == num_rows else rows
        self._xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
        return logits

    def _host_buffer(self, num_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """The host bitmask, free to fill: the copy queued from it last has run."""
        import torch

        host = self._host
        words = self._xgrammar.get_bitmask_shape(1, vocab)[1]
        if host is None or host.shape[0] < num_rows or host.shape[1] != words:
            rows = max(MIN_ROWS, num_rows)
            on_device = device.type != "cpu"
            if self._copied is not None:
                self._copied.synchronize()  # the old buffer may still be read by its copy
            host = torch.empty((rows, words), dtype=torch.int32, pin_memory=on_device)
            self._host = host
            if on_device:
                self._device = torch.empty((rows, words), dtype=torch.int32, device=device)
                self._copied = torch.cuda.Event()
        elif self._copied is not None:
            self._copied.synchronize()
        return host


def _follow_tokens(seqs: list[Sequence], previous: SampledBatch | None) -> list[tuple[int, Any]]:
    """Brings each constrained row's matcher up to the token it samples now; (row, matcher) pairs.
    A row's tokens before this step are on the host but the last, which may still be in flight (a row
    counts this step's token in flight too): it is read from `previous` at the row's sample_row."""
    matchers = []
    inflight: list[int] | None = None
    for i, seq in enumerate(seqs):
        grammar = seq.grammar
        if grammar is None:
            continue
        matcher = grammar.matcher
        matchers.append((i, matcher))
        known = seq.output_token_ids
        target = len(known) + seq.num_inflight - 1
        # One accept_token per token: faster here than BatchGrammarMatcher.batch_accept_token, whose
        # per-call overhead outweighs one token per row. A rejected token (a failed row's) is ignored:
        # that row's request ends with its error.
        while grammar.num_accepted < min(target, len(known)):
            matcher.accept_token(known[grammar.num_accepted])
            grammar.num_accepted += 1
        if grammar.num_accepted < target:
            if previous is None:
                raise RuntimeError(f"{seq.request_id}: a token in flight but no sampled batch holds it")
            if inflight is None:
                inflight = previous.host_token_ids()
            matcher.accept_token(inflight[seq.sample_row])
            grammar.num_accepted += 1
    return matchers
