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
- `GrammarMasks.begin` and `finish`, in the sampler, once per step for all constrained rows: each
  matcher first accepts the tokens sampled since it last masked (the previous step's token is read
  back from that step alone, so the engine keeps launching a step before reading the one before: the
  forward of step n+1 runs on the device while the host waits for step n's tokens and fills n+1's
  masks); then one batched fill of a reused bitmask, on a worker thread while the engine thread goes
  on (it processes step n's tokens, returns the outputs and plans step n+2: LLMEngine.step); then,
  just before step n+2 is launched (finish), one copy of it to the device and one masking kernel. On a
  GPU's decode graphs the bitmask and its row flags fill straight into the masked sampling head's pinned
  inputs, and the head, queued with the forward, waits on the device until the filler releases it
  (MaskedHeadGraphs.ready, kernels/host_signal.py): the engine thread never waits for a fill there.
- On a GPU all of that but the copy and the masking happens in a grammar process of the engine's
  (engine/grammar_process.py; RemoteGrammar here stands for a sequence's matcher there): the engine
  thread sends each step's tokens there, and reads its reply (an error, if any) before the step's
  tokens.

Strings of bounded length (maxLength) are compiled as one rule per character written rather than as
xgrammar's counted repetition (`bounded_strings_as_chains`): the same language and masks, but masks
xgrammar can cache, ~30x cheaper fills with a 128k-id tokenizer.

The grammars work in the tokenizer's ids, not the model's padded vocabulary (`GrammarVocab`): xgrammar
spends time on every id without text in each fill and accept, ~150 us a row with a 2k-token tokenizer
padded to 128k ids, so the ids past the tokenizer are masked apart, on the device.

xgrammar is imported on first use: an engine that never sees a constrained request never loads it."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from modelfleet.dataplane.engine.grammar_process import GrammarProcess, RemoteSchema
    from modelfleet.dataplane.engine.sampler import SampledBatch
    from modelfleet.dataplane.engine.sequence import Sequence
    from modelfleet.dataplane.kernels.host_signal import MaskReady
    from modelfleet.dataplane.kernels.sampling import TokenBitmask

logger = logging.getLogger(__name__)

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
    _parse_schema(_schema(structured))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _parse_schema(schema: str) -> None:
    """Once per schema that parses (a failure is not kept: each request with it gets its error): a
    schema's parse costs ~0.16 ms, paid by every request on the server's event loop before."""
    xgrammar = _xgrammar()
    try:
        # Compact JSON: free whitespace would let a model spend its tokens on spaces.
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its own message
        raise ValueError(f"response_format: the JSON schema cannot be compiled: {exc}") from None


@dataclasses.dataclass(frozen=True)
class GrammarVocab:
    """The ids a grammar works in. A model's vocabulary is often padded past its tokenizer's (to a
    multiple of 64, or a 128k-id checkpoint around a small tokenizer): ids without text that no grammar
    allows. A grammar sees the tokenizer's ids as they are, then any stop id past them (grammar id
    `tokenizer_size + j` stands for `far_stops[j]`); the rest of a row is masked apart."""

    model_size: int  # the logits' width
    tokenizer_size: int  # ids below it are the same in the grammar and the model
    far_stops: tuple[int, ...] = ()  # stop ids in [tokenizer_size, model_size), sorted

    @classmethod
    def of(cls, tokenizer: Any, model_size: int, stop_token_ids: Any) -> GrammarVocab:
        ids = tokenizer.get_vocab().values()
        # As xgrammar counts a tokenizer (ids may have gaps), never past the model's rows.
        tokenizer_size = min(model_size, max(len(ids), max(ids) + 1))
        far = tuple(sorted(t for t in set(stop_token_ids) if tokenizer_size <= t < model_size))
        return cls(model_size, tokenizer_size, far)

    @property
    def size(self) -> int:
        """How many ids the grammar knows (the bitmask's bits)."""
        return self.tokenizer_size + len(self.far_stops)

    @property
    def padded(self) -> bool:
        """Whether the model has ids past the grammar's (masked apart; a far stop's grammar id is then
        not its own). Not padded, any far stops are the model's last ids, in order: the same ids."""
        return self.size < self.model_size

    def grammar_id(self, token: int) -> int:
        """The grammar's id of a model's token; one past the grammar's ids (a rejected token) for an id
        without text."""
        if token < self.tokenizer_size:
            return token
        try:
            return self.tokenizer_size + self.far_stops.index(token)
        except ValueError:
            return self.size


@dataclasses.dataclass(frozen=True)
class CompiledSchema:
    """A schema's compiled grammar, with the ids it works in."""

    grammar: Any  # an xgrammar.CompiledGrammar
    vocab: GrammarVocab


class Grammars:
    """Compiles the grammars of one engine's tokenizer on a worker thread, one compile per schema; or,
    once `start_process` has run, in a grammar process of its own, which then holds the matchers too
    (engine/grammar_process.py)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], cache_size: int = CACHE_SIZE
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.vocab: GrammarVocab | None = None  # with the compiler
        self._compiler: Any = None
        self._tokenizer_info: Any = None  # with the compiler
        self._process: GrammarProcess | None = None
        self._compiled: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        # One worker: compiles use every core xgrammar is given already; more would only contend.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modelfleet-grammar")

    def compile(self, structured: tuple[str, str]) -> Future[Any]:
        """The compiled grammar, made (or being made) on the worker; it fails with ValueError."""
        with self._lock:
            if self._process is not None and not self._process.alive:
                self._restart_process()
            future = self._compiled.get(structured)
            if future is not None and not future.cancelled():
                self._compiled.move_to_end(structured)
                return future
            if self._process is None:
                future = self._pool.submit(self._compile, structured)
            else:
                future = self._process.compile(structured)
            self._compiled[structured] = future
            while len(self._compiled) > self.cache_size:
                _, evicted = self._compiled.popitem(last=False)
                if self._process is not None and evicted.done() and evicted.exception() is None:
                    self._process.forget(evicted.result())
            return future

    def prepare(self) -> GrammarVocab:
        """The compiler made now (xgrammar's import and the tokenizer's grammar vocabulary: ~0.5 s for a
        128k vocabulary), before any compile asks for it; its vocabulary. ValueError as compile's."""
        self._compiler_made()
        assert self.vocab is not None  # made with the compiler
        return self.vocab

    def start_process(self, threads: int | str) -> None:
        """From now on, compiles and matchers live in a grammar process (see its module) with `threads`
        filling each step's bitmask. Compiles made before stay cached here; their matchers stay local."""
        from modelfleet.dataplane.engine.grammar_process import GrammarProcess

        vocab = self.prepare()
        self._process = GrammarProcess(self._tokenizer_info.serialize_json(), vocab, threads)

    def _restart_process(self) -> None:
        """Another grammar process for one that ended (its matchers' requests failed with their steps);
        what it compiled went with it."""
        from modelfleet.dataplane.engine.grammar_process import GrammarProcess

        process = self._process
        assert process is not None
        logger.warning("%s; starting another", process.ended())
        process.close()
        self._compiled.clear()
        self._process = GrammarProcess(self._tokenizer_info.serialize_json(), process.vocab, process.threads)

    def _compile(self, structured: tuple[str, str]) -> CompiledSchema:
        compiler = self._compiler_made()
        assert self.vocab is not None  # made with the compiler
        return CompiledSchema(compile_schema(compiler, structured), self.vocab)

    @staticmethod
    def matcher(compiled: CompiledSchema | RemoteSchema) -> SequenceGrammar | RemoteGrammar:
        """A fresh matcher for one sequence, from a compiled grammar (cheap: on the engine thread); in
        the grammar process for a schema compiled there."""
        if not isinstance(compiled, CompiledSchema):
            return compiled.process.open(compiled)
        import xgrammar

        return SequenceGrammar(xgrammar.GrammarMatcher(compiled.grammar), compiled.vocab)

    def _compiler_made(self) -> Any:
        with self._compiler_lock:  # apart from _lock: compile() must not wait for a compiler to be made
            return self._compiler or self._make_compiler()

    def _make_compiler(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("response_format: structured output needs the model's tokenizer")
        xgrammar = _xgrammar()
        vocab = GrammarVocab.of(self.tokenizer, self.vocab_size, self.stop_token_ids)
        stops = [vocab.grammar_id(t) for t in self.stop_token_ids if t < self.vocab_size]
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=vocab.size, stop_token_ids=stops or None
        )
        self.vocab = vocab
        self._tokenizer_info = info
        self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.close()


def compile_schema(compiler: Any, structured: tuple[str, str]) -> Any:
    """A request's constraint compiled by an xgrammar.GrammarCompiler; ValueError naming the field."""
    schema = _schema(structured)
    try:
        grammar = _compile_bounded_strings(compiler, schema)
        if grammar is None:
            grammar = compiler.compile_json_schema(schema, any_whitespace=False)
    except Exception as exc:
        raise ValueError(f"response_format: the JSON schema cannot be compiled: {exc}") from None
    return grammar


# A string of bounded length (maxLength) as xgrammar writes it: `"\"" chars{min, max} "\""`, where `chars`
# is a rule of one character class.
_BOUNDED_STRING = re.compile(r'"\\"" (\w+)\{(\d+), (\d+)\} "\\""')
_CHAR_CLASS_RULE = re.compile(r"^(\w+) ::= \(\((\[(?:[^\]\\]|\\.)*\])\)\)$")
# What may follow a JSON string: xgrammar's own lookahead for its strings (compact or not).
_AFTER_STRING = r"(=([ \n\r\t]* [,}\]:]))"
# Longer bounds keep xgrammar's form: one rule per character would make compiles slow.
MAX_CHAINED_LENGTH = 256


def _compile_bounded_strings(compiler: Any, schema: str) -> Any:
    """The schema's grammar with its bounded-length strings as chains of rules (bounded_strings_as_chains),
    compiled; None for a schema without one, or whose grammar text xgrammar does not read back (compiled
    as it is: the chains only save time)."""
    xgrammar = _xgrammar()
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    chained = bounded_strings_as_chains(ebnf)
    if chained == ebnf:
        return None
    try:
        return compiler.compile_grammar(chained)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError on text it cannot parse
        logger.warning(
            "structured output: a grammar with bounded strings is compiled without chains (%s: %s)",
            type(exc).__name__,
            exc,
        )
        return None


def bounded_strings_as_chains(ebnf: str) -> str:
    """xgrammar's grammar text with each string of bounded length written as one rule per character
    written so far, each with the lookahead of xgrammar's own strings: the same language and the same
    masks, at a fraction of the cost. xgrammar writes such a string as a counted repetition, whose count
    its token-mask cache cannot hold, so inside the string every token of the vocabulary is checked at
    each step (3 ms a row with a 128k-id byte-level BPE tokenizer, bench/serve.py's long schema). One
    rule per count gives each count its own cached mask, and the lookahead settles most tokens that
    close the string (~0.1 ms a row)."""
    classes = {m[1]: m[2] for m in map(_CHAR_CLASS_RULE.match, ebnf.splitlines()) if m}
    names = set(re.findall(r"^(\w+) ::=", ebnf, flags=re.MULTILINE))
    chains: dict[str, list[str]] = {}

    def chain(match: re.Match) -> str:
        chars, low, high = match[1], int(match[2]), int(match[3])
        prefix = f"{chars}_len_{low}_{high}_"
        if chars not in classes or low > high or high > MAX_CHAINED_LENGTH or f"{prefix}0" in names:
            return match[0]
        if prefix not in chains:
            chains[prefix] = [_chain_rule(prefix, classes[chars], i, low, high) for i in range(high + 1)]
        return f'"\\"" {prefix}0'

    rewritten = _BOUNDED_STRING.sub(chain, ebnf)
    return "\n".join([rewritten.rstrip("\n"), *(rule for rules in chains.values() for rule in rules)]) + "\n"


def _chain_rule(prefix: str, char_class: str, written: int, low: int, high: int) -> str:
    """The rule for a bounded string's rest once `written` characters of it are written."""
    choices = []
    if written >= low:
        choices.append('("\\"")')
    if written < high:
        choices.append(f"({char_class} {prefix}{written + 1})")
    return f"{prefix}{written} ::= ({' | '.join(choices)}) {_AFTER_STRING}"


class SequenceGrammar:
    """One sequence's matcher and how many of its output tokens it has accepted (it follows the tokens
    when its sequence next samples, so tokens still in flight need no wait before that)."""

    __slots__ = ("handle", "matcher", "num_accepted", "vocab")

    def __init__(self, matcher: Any, vocab: GrammarVocab) -> None:
        self.matcher = matcher
        # The matcher's native object, for the once-a-step calls of all rows (_follow_tokens): they skip
        # xgrammar's Python wrappers, which cost more than the calls at 64 rows.
        self.handle = matcher._handle
        self.num_accepted = 0
        self.vocab = vocab

    def accept(self, token: int) -> None:
        """Follows one sampled token. A rejected token (a failed row's) is ignored: that row's request
        ends with its error."""
        self.matcher.accept_token(self.vocab.grammar_id(token))
        self.num_accepted += 1


class RemoteGrammar:
    """One sequence's matcher, held by the grammar process under `slot`, and how many of its output
    tokens it has followed (as structured.SequenceGrammar's num_accepted)."""

    __slots__ = ("num_accepted", "process", "slot", "vocab")

    def __init__(self, process: GrammarProcess, slot: int, vocab: GrammarVocab) -> None:
        self.process = process
        self.slot = slot
        self.vocab = vocab
        self.num_accepted = 0

    def __del__(self) -> None:
        self.process.release(self.slot)


# Rows of bitmask kept for reuse, at least; the buffers grow with the batch.
MIN_ROWS = 64
# Threads filling one step's bitmask rows: "auto" is xgrammar's (half the cores) in the engine's process,
# 2 in a grammar process (grammar_process._SplitFill), unless set to a number.
FILL_THREADS_ENV = "MODELFLEET_GRAMMAR_THREADS"


# Where an engine's grammars live: "process" (a process of their own, engine/grammar_process.py) or
# "thread" (the engine's process: matchers followed on the engine thread, fills on a worker thread).
# Unset: a process where decode steps sample in CUDA graphs (a GPU's), else the engine's.
GRAMMARS_ENV = "MODELFLEET_GRAMMARS"


def grammars_in_process(default: bool) -> bool:
    """Whether the environment puts an engine's grammars in a process of their own; `default` if unset."""
    value = os.environ.get(GRAMMARS_ENV, "").strip()
    if value not in ("", "process", "thread"):
        raise ValueError(f"{GRAMMARS_ENV}: {value!r} must be 'process' or 'thread'")
    return default if not value else value == "process"


def fill_threads() -> int | str:
    """The environment's thread count for GrammarMasks; read when a sampler is made, so that a bad value
    stops the engine at its start rather than failing a batch."""
    value = os.environ.get(FILL_THREADS_ENV, "auto").strip()
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{FILL_THREADS_ENV}: {value!r} must be 'auto' or a number of threads >= 1")
    return int(value)


@dataclasses.dataclass
class BegunMasks:
    """One step's masks begun (GrammarMasks.begin): the rows' matchers follow their tokens, and their
    bitmask rows fill in the host buffer, on the worker thread while `fill` runs."""

    rows: list[int]
    vocab: GrammarVocab
    num_rows: int
    host: torch.Tensor  # the bitmask it fills
    fill: _FillWorker | GrammarProcess | None  # None: filled already


class _FillWorker:
    """The thread that runs a step's bitmask fill while the engine thread goes on; one fill at a time.

    The handoff is two plain locks (no pool, no futures: their Python-level conditions cost a few
    GIL round trips a step). `start` waits, without the GIL, until the worker holds the job, which hands
    it the GIL at once; else it would wait for the engine thread's Python to give it up (the
    interpreter's 5 ms switch interval) and start too late to overlap anything. It keeps the GIL only
    until the fill releases it. `wait` blocks, without the GIL, until the fill has ended."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, list[Any], Any, list[int], Any]] = queue.SimpleQueue()
        self._started = threading.Lock()
        self._started.acquire()
        self._ended = threading.Lock()
        self._ended.acquire()
        self._error: BaseException | None = None
        self._running = False
        # A daemon: it holds nothing when idle, blocked on the queue, and ends with the process.
        threading.Thread(target=self._run, name="modelfleet-grammar-fill", daemon=True).start()

    def start(
        self, filler: Any, matchers: list[Any], host: Any, rows: list[int], ready: MaskReady | None = None
    ) -> None:
        """Starts a fill; `ready` (a masked head's) is released once it has ended, whatever its end."""
        if self._running:  # a step dropped before its finish: its fill (and any error) goes with it
            self._join()
        self._running = True
        self._jobs.put((filler, matchers, host, rows, ready))
        self._started.acquire()

    def wait(self) -> None:
        """Until the fill started last has ended; raises its error, if any."""
        if self._running:
            error = self._join()
            if error is not None:
                raise error

    def _join(self) -> BaseException | None:
        self._ended.acquire()
        self._running = False
        error, self._error = self._error, None
        return error

    def _run(self) -> None:
        while True:
            filler, matchers, host, rows, ready = self._jobs.get()
            self._started.release()
            try:
                filler.batch_fill_next_token_bitmask(matchers, host, indices=rows)
            except BaseException as exc:  # raised on the engine thread, by wait
                self._error = exc
            if ready is not None:
                ready.release()
            self._ended.release()


class GrammarMasks:
    """A sampler's grammar work for each step, for all its constrained rows at once (see the module's
    docstring). The bitmask lives in one host buffer (pinned for a device) reused every step, and its
    device copy in one device buffer; an event guards the host buffer until its copy has run.

    The work comes in two halves so that the engine thread can do other work while the fill runs:
    `begin` (the accepts, then the fill started on a worker thread: xgrammar's fill holds no GIL) and
    `finish` (the wait for the fill, the copy and the masking) or, for the fused GPU sampler,
    `finish_bitmask` (the wait and the copy: the sampling kernel reads the bitmask itself) or, for a
    bitmask filled into the caller's buffer (begin's `into`), `wait`; `apply` is begin and finish at once."""

    def __init__(self, threads: int | str = "auto") -> None:
        xgrammar = _xgrammar()
        self._xgrammar = xgrammar
        # xgrammar's pool, which fills the rows of one step in parallel (threads: see fill_threads).
        self._filler = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self._worker: _FillWorker | None = None  # started with the first fill in the background
        self._host: torch.Tensor | None = None
        self._shared = False  # whether _host lies in shared memory
        self._device: torch.Tensor | None = None
        self._copied: Any = None  # a CUDA event once a copy was queued
        self._padding: _PaddingMask | None = None
        self._far_ids: tuple[GrammarVocab, torch.Tensor] | None = None  # finish_bitmask's, on the device
        self._ones: torch.Tensor | None = None  # finish_bitmask's row flags of a fully constrained batch

    def apply(
        self, logits: torch.Tensor, seqs: list[Sequence], previous: SampledBatch | None
    ) -> torch.Tensor:
        """Masks, in place, each constrained row's logits to what its grammar allows next. `previous`:
        the sampler's batch before this one, which holds any token still in flight of these rows."""
        begun = self.begin(logits.shape, logits.device, seqs, previous, background=False)
        return logits if begun is None else self.finish(begun, logits)

    def begin(
        self,
        shape: tuple[int, int],
        device: torch.device,
        seqs: list[Sequence],
        previous: SampledBatch | None,
        *,
        background: bool,
        into: torch.Tensor | None = None,
        ready: MaskReady | None = None,
    ) -> BegunMasks | None:
        """Brings the matchers up to date (this waits for `previous`'s tokens), then fills their bitmask:
        on the worker thread if `background` (returned once the worker holds the fill), else here. None
        where no row is constrained any more. `shape` and `device`: the step's logits' (rows, model ids).
        The bitmask fills this sampler's host buffer, or `into` (int32 [>= rows, words] on the host, free
        to fill: a graph's pinned input buffer), or `ready`'s (a decode graph's masked head, which waits
        on the device: its row flags are written and its number released once the bitmask has filled;
        a step that fails is its runner's to release). `wait` ends a step filled into the caller's
        buffer. Matchers in a grammar process follow and fill there: the rows still constrained are known
        once the fill has ended (the begun masks' rows, empty until then, may stay empty)."""
        if ready is not None:
            into = ready.bits
        first = next(s.grammar for s in seqs if s.grammar is not None)
        if isinstance(first, RemoteGrammar):  # one engine's grammars all live in one place
            return self._begin_remote(first, shape, device, seqs, previous, background, into, ready)
        live = _follow_tokens(seqs, previous)
        if not live:
            if ready is not None:
                ready.mark([])
            return None
        rows = [i for i, _ in live]
        vocab = live[0][1].vocab  # one engine, one tokenizer: the same for every row
        num_rows = shape[0]
        host = self._fill_buffer(vocab, shape, device, into, shared=False)
        if ready is not None:
            ready.flag(rows)
        matchers = [g.matcher for _, g in live]
        if not background:
            self._filler.batch_fill_next_token_bitmask(matchers, host, indices=rows)
            if ready is not None:
                ready.release()
            return BegunMasks(rows, vocab, num_rows, host, None)
        if self._worker is None:
            self._worker = _FillWorker()
        self._worker.start(self._filler, matchers, host, rows, ready)
        return BegunMasks(rows, vocab, num_rows, host, self._worker)

    def _begin_remote(
        self,
        first: RemoteGrammar,
        shape: tuple[int, int],
        device: torch.device,
        seqs: list[Sequence],
        previous: SampledBatch | None,
        background: bool,
        into: torch.Tensor | None,
        ready: MaskReady | None,
    ) -> BegunMasks:
        """begin, for matchers in a grammar process: the step sent there, its reply read in the wait."""
        num_rows, vocab = shape[0], first.vocab
        host = self._fill_buffer(vocab, shape, device, into, shared=True)
        first.process.start(seqs, previous, num_rows, host, ready)
        begun = BegunMasks([], vocab, num_rows, host, first.process)
        if not background:
            self._filled_host(begun)
        return begun

    def _fill_buffer(
        self,
        vocab: GrammarVocab,
        shape: tuple[int, int],
        device: torch.device,
        into: torch.Tensor | None,
        *,
        shared: bool,
    ) -> torch.Tensor:
        """The host bitmask a step of `shape` (rows, model ids) fills: this sampler's own (in shared
        memory if `shared`), or the caller's `into`, once both are checked."""
        num_rows, width = shape
        if width != vocab.model_size:
            raise ValueError(f"logits of {width} ids for grammars of a {vocab.model_size}-id model")
        words = bitmask_layout(vocab).words
        host = self._host_buffer(num_rows, words, device, shared) if into is None else into
        if host.shape[0] < num_rows or host.shape[1] != words or host.element_size() != 4:
            raise ValueError(f"a bitmask buffer of {tuple(host.shape)} for {num_rows} rows of {words} int32")
        return host

    def finish(self, begun: BegunMasks, logits: torch.Tensor) -> torch.Tensor:
        """Waits for the fill (raising its error, if any), then masks `logits` in place: one copy of the
        bitmask to the device and one masking kernel (and the padded ids')."""
        host = self._filled_host(begun)
        rows, vocab, num_rows = begun.rows, begun.vocab, begun.num_rows
        if not rows:  # every grammar has ended (known only now for a grammar process's)
            return logits
        logits = logits.contiguous()
        bitmask = host if logits.device.type == "cpu" else self._to_device(host)
        # Every row constrained (the usual batch of one schema): no indices to send along.
        indices = None if len(rows) == num_rows else rows
        direct = vocab.tokenizer_size if vocab.padded else vocab.size
        self._xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=direct, indices=indices)
        if vocab.padded:
            if self._padding is None or self._padding.vocab != vocab or self._padding.device != logits.device:
                self._padding = _PaddingMask(vocab, logits.device)
            self._padding.apply(logits, bitmask, host, indices)
        return logits

    def finish_bitmask(self, begun: BegunMasks, device: torch.device) -> TokenBitmask:
        """Waits for the fill (raising its error, if any), then copies the bitmask to `device` for the
        fused sampling kernel to read, with which rows it masks (the constrained ones)."""
        import torch
        from modelfleet.dataplane.engine.device_copy import to_device
        from modelfleet.dataplane.kernels.sampling import TokenBitmask

        host = self._filled_host(begun)
        rows, vocab, num_rows = begun.rows, begun.vocab, begun.num_rows
        layout = bitmask_layout(vocab)
        if self._far_ids is None or self._far_ids[0] != vocab or self._far_ids[1].device != device:
            self._far_ids = (vocab, torch.tensor(layout.far_ids, dtype=torch.int32).to(device))
        direct = layout.num_direct
        if len(rows) == num_rows:  # the usual batch, every row constrained: nothing more to copy
            flags = self._all_rows(num_rows, device)
        else:
            flags = torch.zeros(num_rows, dtype=torch.int32)
            flags[rows] = 1
            flags = to_device(flags, device)
        bits = host if device.type == "cpu" else self._to_device(host)
        return TokenBitmask(bits, direct, self._far_ids[1], flags)

    def wait(self, begun: BegunMasks) -> list[int]:
        """Waits for a fill into a buffer of the caller's (begin's `into`), raising its error, if any; the
        rows it masks."""
        self._filled_host(begun)
        return begun.rows

    def _all_rows(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """int32 ones [num_rows] on `device`, made once for the largest batch seen."""
        import torch

        ones = self._ones
        if ones is None or ones.shape[0] < num_rows or ones.device != device:
            ones = self._ones = torch.ones(max(MIN_ROWS, num_rows), dtype=torch.int32, device=device)
        return ones[:num_rows]

    def _filled_host(self, begun: BegunMasks) -> torch.Tensor:
        """The host bitmask's rows of this step, once filled (and the begun masks' rows, once known)."""
        fill, begun.fill = begun.fill, None
        if isinstance(fill, _FillWorker):
            fill.wait()
        elif fill is not None:
            begun.rows = fill.wait(begun.host)
        return begun.host[: begun.num_rows]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Queues the host bitmask's copy to the device buffer (the event marks it queued)."""
        assert self._device is not None  # made with the pinned host buffer
        bitmask = self._device[: host.shape[0]].copy_(host, non_blocking=True)
        self._copied.record()
        return bitmask

    def _host_buffer(self, num_rows: int, words: int, device: torch.device, shared: bool) -> torch.Tensor:
        """The host bitmask, free to fill: the copy queued from it last has run. `shared`: in shared
        memory, where a grammar process fills it itself (engine/shared_host.py)."""
        import torch
        from modelfleet.dataplane.engine.shared_host import host_bytes

        if self._copied is not None:
            self._copied.synchronize()
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != words or self._shared != shared:
            rows = max(MIN_ROWS, num_rows, 2 * host.shape[0] if host is not None else 0)  # few regrowths
            on_device = device.type != "cpu"
            memory = host_bytes(rows * words * 4, pinned=on_device, shared=shared)
            host = memory.view(torch.int32).view(rows, words)
            self._host, self._shared = host, shared
            if on_device:
                self._device = torch.empty((rows, words), dtype=torch.int32, device=device)
                self._copied = torch.cuda.Event()
        return host


class BitmaskLayout(NamedTuple):
    """How a bitmask of `vocab`'s grammar ids is laid out for the sampling kernel (TokenBitmask)."""

    words: int  # int32 words in one row
    num_direct: int  # model ids below it are grammar ids as they are
    far_ids: tuple[int, ...]  # the model ids of the grammar ids past num_direct


@functools.cache
def bitmask_layout(vocab: GrammarVocab) -> BitmaskLayout:
    """`vocab`'s BitmaskLayout, once per vocabulary (read on every constrained step). Not padded, the far
    stops are the model's last ids, in order, and every id is direct."""
    words = _xgrammar().get_bitmask_shape(1, vocab.size)[1]
    if vocab.padded:
        return BitmaskLayout(words, vocab.tokenizer_size, vocab.far_stops)
    return BitmaskLayout(words, vocab.model_size, ())


class _PaddingMask:
    """Masks a padded model's ids past its grammars' (see GrammarVocab): all of them, but a far stop id
    where its row's bitmask allows its grammar id. The host's bitmask tells whether any row allows one
    (rarely: an answer just complete); if none does, one fill of the rows' padded columns is all."""

    def __init__(self, vocab: GrammarVocab, device: torch.device) -> None:
        import torch

        self.vocab = vocab
        self.device = device
        # Where each far stop's bit lies in a bitmask row: its word and its shift in that word.
        grammar_ids = torch.arange(vocab.tokenizer_size, vocab.size, dtype=torch.int32)
        words, shifts = grammar_ids // 32, grammar_ids % 32
        self._host_words, self._host_shifts = words.numpy(), shifts.numpy()
        self._far = torch.tensor(vocab.far_stops, dtype=torch.long).to(device)
        self._words = words.long().to(device)
        self._shifts = shifts.to(device)

    def apply(
        self, logits: torch.Tensor, bitmask: torch.Tensor, host: torch.Tensor, indices: list[int] | None
    ) -> None:
        """`bitmask`: the rows' bitmask where the logits are; `host`: the same on the host."""
        import torch
        from modelfleet.dataplane.engine.device_copy import to_device

        rows: Any = slice(None)
        if indices is not None:
            rows = to_device(torch.tensor(indices, dtype=torch.long), logits.device)
        start = self.vocab.tokenizer_size
        host_bits = (host.numpy()[:, self._host_words] >> self._host_shifts) & 1
        if not host_bits[slice(None) if indices is None else indices].any():
            logits[rows, start:] = -torch.inf
            return
        far_cells = (rows if indices is None else rows.unsqueeze(1), self._far)
        allowed = ((bitmask[rows][:, self._words] >> self._shifts) & 1).bool()
        kept = torch.where(allowed, logits[far_cells], -torch.inf)
        logits[rows, start:] = -torch.inf
        logits[far_cells] = kept


def due_tokens(seqs: list[Sequence], previous: SampledBatch | None) -> list[tuple[int, Any, list[int], int]]:
    """What each constrained row's matcher follows before the row samples now: (row, grammar, the known
    tokens it is behind on, its token in flight or -1), each grammar's num_accepted moved past them. A
    row's tokens before this step are on the host but the last, which may still be in flight (a row
    counts this step's token in flight too): it is read from `previous` at the row's sample_row. Once
    per step for every constrained row, wherever the matchers live: plain code."""
    due: list[tuple[int, Any, list[int], int]] = []
    inflight: list[int] | None = None
    for i, seq in enumerate(seqs):
        grammar = seq.grammar
        if grammar is None:
            continue
        known = seq.output_token_ids
        accepted = grammar.num_accepted
        target = len(known) + seq.num_inflight - 1
        behind = _NONE_BEHIND
        token = -1
        if accepted < target:
            if accepted < len(known):  # a row behind: its known tokens first
                behind = known[accepted : min(target, len(known))]
                accepted += len(behind)
            if accepted < target:
                if inflight is None:
                    if previous is None:
                        raise RuntimeError(
                            f"{seq.request_id}: a token in flight but no sampled batch holds it"
                        )
                    inflight = previous.host_token_ids()
                token = inflight[seq.sample_row]
                accepted += 1
            grammar.num_accepted = accepted
        due.append((i, grammar, behind, token))
    return due


_NONE_BEHIND: list[int] = []  # shared, never changed


def _follow_tokens(seqs: list[Sequence], previous: SampledBatch | None) -> list[tuple[int, SequenceGrammar]]:
    """Brings each constrained row's matcher up to the token it samples now (due_tokens); (row, grammar)
    pairs of the rows whose grammar is not yet terminated (a terminated one has accepted its end: its
    sequence is ending, and the row's token is dropped). The usual case, one token in flight a row, is
    accepted by all rows in one native call (a rejected token, a failed row's, is ignored there too)."""
    rows: list[tuple[int, SequenceGrammar]] = []
    handles: list[Any] = []
    tokens: list[int] = []
    for i, grammar, behind, token in due_tokens(seqs, previous):
        for t in behind:
            grammar.matcher.accept_token(grammar.vocab.grammar_id(t))
        if token >= 0:
            handles.append(grammar.handle)
            tokens.append(grammar.vocab.grammar_id(token))
        rows.append((i, grammar))
    if handles:
        _accept_tokens(handles, tokens)
    return [(i, grammar) for i, grammar in rows if not grammar.handle.is_terminated()]


def _accept_tokens(handles: list[Any], tokens: list[int]) -> None:
    """handles[i] accepts tokens[i], in one call without the interpreter lock. xgrammar's own
    BatchGrammarMatcher.batch_accept_token wraps this call and converts its result row by row, which
    costs more than one accept_token a row (its core is what it calls: pinned, see pyproject.toml)."""
    _xgrammar().base._core.BatchGrammarMatcher.batch_accept_token(handles, tokens, False)
