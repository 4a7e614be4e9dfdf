"""Structured output: a request's JSON schema (or "any JSON object") compiled by xgrammar into a grammar
whose matcher, one per sequence, masks the logits of every step to the tokens that keep the output
valid. The matcher follows the sampled tokens (LLMEngine._process), so a constrained sequence's next
step waits for its previous token (as penalties do); once the JSON is complete only end-of-sequence
tokens remain allowed.

Where the work happens:
- `check_structured`, on the caller's side (PromptChecks.validate): the schema is parsed into a grammar
  (no tokenizer, fast), so a bad schema is refused (a 400) before anything is queued.
- `Grammars.compile`, on a worker thread: the grammar's token masks over the whole vocabulary (the
  slow part) are built there, once per schema (cached), while the engine thread keeps stepping the
  other requests; a request joins the scheduler once its grammar is ready.

xgrammar is imported on first use: an engine that never sees a constrained request never loads it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

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
    def matcher(compiled: Any) -> Any:
        """A fresh matcher for one sequence, from a compiled grammar (cheap: on the engine thread)."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

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


def apply_grammars(logits: Any, seqs: list) -> Any:
    """Masks, in place, each constrained row's logits to what its grammar allows next."""
    import xgrammar

    # A terminated matcher (it has accepted its end) has no next token to allow; its sequence is ending.
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None and not seq.grammar.is_terminated()]
    if not rows:
        return logits
    bitmask = xgrammar.allocate_token_bitmask(len(seqs), logits.shape[-1])
    for i in rows:
        seqs[i].grammar.fill_next_token_bitmask(bitmask, i)
    logits = logits.contiguous()
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits
