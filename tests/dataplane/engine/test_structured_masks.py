"""The sampler's grammar masks follow each row's tokens themselves, a token still in flight included, so
constrained requests keep the engine's overlap (step n+1 launched before step n's tokens are read)
without changing a token: every output token is one its grammar allowed at that point, and the tokens
equal those of the same batch run with each step's tokens read before the next is launched.

The masks' bitmask fills on a worker thread while the engine thread processes the previous step's
tokens and plans the next step (Sampler.begin, then LaunchedStep.finish before the next launch): the
same tokens as with the fill on the engine thread (Sampler.begin(overlap=False)), and an error inside
the fill fails a step."""

from __future__ import annotations

import functools
import json
import threading
import time

import numpy as np
import pytest
import torch
import xgrammar
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine import llm_engine
from modelfleet.dataplane.engine.structured import GrammarMasks, Grammars

from .test_overlap import record_launches

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2},
            "n": {"type": "integer"},
        },
        "required": ["items", "n"],
    }
)


@pytest.fixture
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")


def batch() -> tuple[list[str], list[SamplingParams]]:
    structured = ("json_schema", SCHEMA)
    prompts = ["one", "two two", "three three three", "four"]
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, structured=structured),
        SamplingParams(max_tokens=48, temperature=0.9, seed=7, structured=structured),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.0, structured=("json_object", "")),
    ]
    return prompts, params


def allowed_throughout(llm: LLM, structured: tuple[str, str], token_ids: list[int]) -> bool:
    """Whether a fresh matcher accepts every token in order (each was allowed where it was sampled)."""
    engine = llm.engine
    # A compiler of its own: the engine's grammars may be in a grammar process.
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiled = grammars.compile(structured).result()
    grammars.close()
    matcher = xgrammar.GrammarMatcher(compiled.grammar)
    return all(matcher.accept_token(compiled.vocab.grammar_id(t)) for t in token_ids)


def check_overlap_and_tokens(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts, params = batch()
    events = record_launches(llm)
    overlapped = llm.generate(prompts, params)
    results = [e[1] for e in events if e[0] == "result"]
    assert len(results) > 10
    # Every step's tokens but the last are read after the next step was launched.
    for n in results[:-1]:
        position = events.index(("result", n))
        assert sum(1 for e in events[:position] if e[0] == "launch") == n + 2

    for out, p in zip(overlapped, params, strict=True):
        if p.structured is None:
            assert len(out.token_ids) == 20
            continue
        assert allowed_throughout(llm, p.structured, out.token_ids)
        if out.finish_reason == "stop":
            json.loads(out.text)  # a complete answer is valid JSON

    # The same batch with the fill on the engine thread, then also with each step's tokens on the host
    # before the next launch: the same tokens.
    sampler = llm.engine.runner.sampler
    monkeypatch.setattr(sampler, "begin", functools.partial(sampler.begin, overlap=False))
    serial = llm.generate(prompts, params)
    assert [o.token_ids for o in serial] == [o.token_ids for o in overlapped]
    monkeypatch.setattr(llm_engine, "_needs_host_tokens", lambda scheduled: True)
    synced = llm.generate(prompts, params)
    assert [o.token_ids for o in synced] == [o.token_ids for o in overlapped]


def test_constrained_rows_keep_the_overlap_and_their_tokens(llm, monkeypatch):
    check_overlap_and_tokens(llm, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_constrained_decode_steps_replay_the_masked_head(tiny_model_dir, monkeypatch):
    """On a GPU a constrained decode step replays the forward graph, then, once its bitmask has filled,
    the masked sampling head's own graph (captured at start for every batch size): the same tokens,
    greedy and seeded, as the eager engine, whose fused sampler reads the same bitmask from its own
    device copy; and the overlap and the grammars' checks hold."""
    settings = dict(max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cuda")
    graphs = LLM(tiny_model_dir, **settings)
    runner = graphs.engine.runner
    assert runner.sampler.fused, "Triton is expected wherever a CUDA GPU is"
    prompts, params = batch()
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert runner.masked_head is not None and runner.masked_head.graphs
    eager = LLM(tiny_model_dir, enforce_eager=True, **settings)
    assert eager.engine.runner.decode_graphs is None
    assert got == [o.token_ids for o in eager.generate(prompts, params)]
    ready = runner.masked_head.ready(1)
    assert ready.bits.is_pinned() and ready.flags.is_pinned()  # filled in place, copied in the head's graph
    assert ready.number == ready.signal.queued + 1 and int(ready.signal.host[0]) == ready.signal.queued
    check_overlap_and_tokens(graphs, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_structured_output_is_ready_before_the_first_request(tiny_model_dir, monkeypatch):
    """A GPU engine prepares structured output at start (LLMEngine._prepare_structured): the grammar
    compiler is made and the masked sampling head captured at each of its decode graphs' batch sizes, so
    the first constrained requests compile no sampling kernel (on an H200 that compile stalled every
    stream for ~0.85 s) and capture no graph."""
    from triton.runtime.jit import JITFunction

    llm = LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cuda")
    engine = llm.engine
    assert engine._grammars is not None and engine._grammars.vocab is not None
    head = engine.runner.masked_head
    assert head is not None and sorted(head.graphs) == engine.runner.decode_graphs.batch_sizes
    captured = dict(head.graphs)
    compiled: list[str] = []
    do_compile = JITFunction._do_compile

    def counted(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counted)
    prompts, params = batch()
    outputs = llm.generate(prompts, params)
    assert all(o.token_ids for o in outputs)
    assert [name for name in compiled if name in ("_chunk_kernel", "_reduce_kernel")] == []
    assert head.graphs == captured  # the same graph objects: none captured while serving


def test_a_cpu_engine_prepares_no_structured_output(llm):
    """Off a GPU nothing is made at start: a CPU engine pays for xgrammar only with a constrained request."""
    assert not llm.engine.runner.samples_in_graphs and llm.engine._grammars is None


def test_an_engine_whose_steps_sample_in_graphs_prepares_at_start(tiny_model_dir, monkeypatch):
    """Where decode steps sample in graphs, the engine makes the grammar compiler at start and hands the
    runner its vocabulary (the GPU test above compiles the kernels); constrained requests then use it."""
    from modelfleet.dataplane.engine.model_runner import ModelRunner

    prepared = []
    monkeypatch.setattr(ModelRunner, "samples_in_graphs", property(lambda self: True))
    monkeypatch.setattr(ModelRunner, "prepare_structured", lambda self, vocab: prepared.append(vocab))
    llm = LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")
    grammars = llm.engine._grammars
    assert grammars is not None and prepared == [grammars.vocab]
    grammars._make_compiler = lambda: pytest.fail("a second compiler was made")
    structured = ("json_schema", SCHEMA)
    (out,) = llm.generate(["one"], SamplingParams(max_tokens=16, temperature=0.0, structured=structured))
    assert out.token_ids and allowed_throughout(llm, structured, out.token_ids)


def test_an_engine_starts_where_its_kernels_do_not_fit_to_compile(tiny_model_dir, monkeypatch, caplog):
    """The kernels' compile at start runs after the KV cache took its memory: out of GPU memory there, the
    engine still starts, its grammar compiler made, and its kernels compile at the first request."""
    from modelfleet.dataplane.engine.model_runner import ModelRunner

    def out_of_memory(self, vocab):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ModelRunner, "samples_in_graphs", property(lambda self: True))
    monkeypatch.setattr(ModelRunner, "prepare_structured", out_of_memory)
    llm = LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")
    assert llm.engine._grammars is not None and llm.engine._grammars.vocab is not None
    assert "not compiled at start: out of GPU memory" in caplog.text


def test_a_prepared_compiler_is_the_one_compiles_use(llm):
    engine = llm.engine
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    made = []
    make = grammars._make_compiler
    grammars._make_compiler = lambda: made.append(1) or make()
    vocab = grammars.prepare()
    assert vocab.model_size == engine.vocab_size and made == [1]
    assert grammars.compile(("json_schema", SCHEMA)).result().vocab == vocab
    assert grammars.prepare() == vocab and made == [1]  # once
    grammars.close()


def test_a_token_in_flight_without_its_batch_is_an_error():
    class Grammar:
        matcher, num_accepted = object(), 0

    class Seq:
        request_id, grammar, output_token_ids, num_inflight, sample_row = "r", Grammar(), [], 2, 0

    with pytest.raises(RuntimeError, match="r: a token in flight but no sampled batch holds it"):
        GrammarMasks().apply(torch.zeros(1, 32), [Seq()], None)


def test_the_fill_threads_come_from_the_environment(monkeypatch):
    from modelfleet.dataplane.engine.structured import FILL_THREADS_ENV, fill_threads

    assert fill_threads() == "auto"
    monkeypatch.setenv(FILL_THREADS_ENV, "3")
    assert fill_threads() == 3
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv(FILL_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"^{FILL_THREADS_ENV}: '{bad}' must be 'auto'"):
            fill_threads()


def slow_fills(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[tuple[str, float, float]]:
    """Every bitmask fill takes `seconds` more (a sleep: no GIL held, as xgrammar's fill holds none);
    returns (thread name, start, end) of each."""
    fills: list[tuple[str, float, float]] = []
    begin = GrammarMasks.begin

    def slow_begin(self, *args, **kwargs):
        filler = self._filler
        if not isinstance(filler, SlowFiller):
            self._filler = SlowFiller(filler, seconds, fills)
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(GrammarMasks, "begin", slow_begin)
    return fills


class SlowFiller:
    def __init__(self, filler, seconds: float, fills: list) -> None:
        self.filler, self.seconds, self.fills = filler, seconds, fills
        self.error: Exception | None = None

    def batch_fill_next_token_bitmask(self, *args, **kwargs):
        start = time.monotonic()
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        self.filler.batch_fill_next_token_bitmask(*args, **kwargs)
        self.fills.append((threading.current_thread().name, start, time.monotonic()))


def test_the_previous_step_is_processed_while_the_fill_runs(llm, monkeypatch):
    fills = slow_fills(monkeypatch, 0.05)
    processed: list[tuple[float, float]] = []
    engine = llm.engine
    process = engine._process

    def timed_process(*args):
        start = time.monotonic()
        outputs = process(*args)
        processed.append((start, time.monotonic()))
        return outputs

    monkeypatch.setattr(engine, "_process", timed_process)
    structured = ("json_schema", SCHEMA)
    llm.generate(["one", "two two"], SamplingParams(max_tokens=24, temperature=0.0, structured=structured))
    assert len(fills) > 10
    assert {name for name, _, _ in fills} == {"modelfleet-grammar-fill"}
    # Each fill but the first step's (no step before it) runs beside a whole _process of the step before;
    # a loaded host may delay the engine thread past a few of the 50 ms fills.
    overlapped = sum(any(f0 <= p0 and p1 <= f1 for p0, p1 in processed) for _, f0, f1 in fills)
    assert overlapped >= 0.75 * len(fills)


def test_an_error_inside_the_fill_fails_the_step(llm, monkeypatch):
    fills = slow_fills(monkeypatch, 0.0)
    engine = llm.engine
    structured = ("json_schema", SCHEMA)
    engine.add_request("a", "one", SamplingParams(max_tokens=30, temperature=0.0, structured=structured))
    while len(fills) < 3:
        engine.step()
    engine.runner.sampler._grammar_masks._filler.error = RuntimeError("the fill broke")
    # A step whose fill fails raises when its sampling is queued, before the next launch: the step
    # launched last (if its fill had not begun) or the next.
    with pytest.raises(RuntimeError, match=r"^the fill broke$"):
        for _ in range(2):
            engine.step()
    assert engine._launched is None  # the failed step is dropped, not processed later
    # As the engine process does after a failed step: every request aborted, then the engine serves on.
    engine.abort("a")
    # A failed step with none launched after it (its request aborted meanwhile) raises and is dropped too.
    engine.add_request("b", "two", SamplingParams(max_tokens=30, temperature=0.0, structured=structured))
    engine.step()  # b's prefill: its fill fails on the worker
    engine.abort("b")
    with pytest.raises(RuntimeError, match=r"^the fill broke$"):
        engine.step()
    assert engine._launched is None and engine.step() == []
    engine.runner.sampler._grammar_masks._filler.error = None
    engine.add_request("c", "two", SamplingParams(max_tokens=30, temperature=0.0, structured=structured))
    outputs = []
    while engine.has_unfinished_requests() or engine._launched is not None:
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].error is None
    assert allowed_throughout(llm, structured, outputs[-1].token_ids)


def test_the_fused_path_keeps_its_seeded_tokens(llm, monkeypatch):
    """The fused sampler (the GPU's for these rows), its kernel replaced by the torch reference on the
    CPU: a seeded row's noise follows its token index, read when the sampling begins, before the next
    step's planning counts another token in flight; the same tokens as the serial fill."""
    from modelfleet.dataplane.kernels import sampling

    from tests.dataplane.kernels.reference import sample_tokens_native

    monkeypatch.setattr(sampling, "sample_tokens", sample_tokens_native)
    sampler = llm.engine.runner.sampler
    monkeypatch.setattr(sampler, "fused", True)
    structured = ("json_schema", SCHEMA)
    prompts = ["one", "two two", "three three three"]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=structured) for s in (1, 2, 3)
    ]
    overlapped = llm.generate(prompts, params)
    monkeypatch.setattr(sampler, "begin", functools.partial(sampler.begin, overlap=False))
    serial = llm.generate(prompts, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in serial]
    for out in overlapped:
        assert len(out.token_ids) > 5
        assert allowed_throughout(llm, structured, out.token_ids)


def test_the_matchers_follow_their_tokens_as_one_accept_a_token_would(llm):
    """_follow_tokens accepts the tokens in flight of all rows in one native call: each matcher ends in
    the state that one accept_token a token gives, for a row behind (its known tokens first), a row
    whose token in flight the grammar rejects (a failed row's: ignored) and a row that ends its grammar."""
    from types import SimpleNamespace

    from modelfleet.dataplane.engine.structured import _follow_tokens

    engine = llm.engine
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiled = grammars.compile(("json_schema", SCHEMA)).result()
    encode = functools.partial(engine.tokenizer.encode, add_special_tokens=False)
    answer = encode('{"items": ["ab", "cd"], "n": 7}')
    rows = [  # (tokens known on the host, the token in flight)
        (answer[:3], answer[3]),  # the usual row: one token in flight
        ([], answer[0]),  # the first token
        (answer[:5], answer[5]),  # behind: it has accepted none of its known tokens yet
        ([], encode("}")[0]),  # rejected: no answer starts with "}"
        (answer, min(engine.eos_token_ids)),  # ends its grammar: not live any more
    ]
    seqs = []
    for row, (known, _) in enumerate(rows):
        grammar = Grammars.matcher(compiled)
        if row != 2:  # the others have followed their known tokens already
            for t in known:
                grammar.accept(t)
        seqs.append(
            SimpleNamespace(grammar=grammar, output_token_ids=list(known), num_inflight=2, sample_row=row)
        )
    live = _follow_tokens(seqs, SimpleNamespace(host_token_ids=lambda: [t for _, t in rows]))
    assert [i for i, _ in live] == [0, 1, 2, 3]
    for (known, token), seq in zip(rows, seqs, strict=True):
        reference = xgrammar.GrammarMatcher(compiled.grammar)
        for t in [*known, token]:
            reference.accept_token(compiled.vocab.grammar_id(t))
        assert seq.grammar.num_accepted == len(known) + 1
        assert seq.grammar.matcher.is_terminated() == reference.is_terminated()
        if not reference.is_terminated():
            ours, theirs = (xgrammar.allocate_token_bitmask(1, compiled.vocab.size) for _ in range(2))
            seq.grammar.matcher.fill_next_token_bitmask(ours)
            reference.fill_next_token_bitmask(theirs)
            assert torch.equal(ours, theirs)
    grammars.close()


def test_the_bitmask_fills_into_a_buffer_of_the_callers(llm):
    """A decode graph's masked head has the grammars fill its pinned input mirror (begin's `into`, then
    `wait`): the rows its own buffer would hold, in place, the unconstrained row left as it was, on the
    worker thread; a buffer that does not fit the rows is refused before any fill."""
    from types import SimpleNamespace

    from modelfleet.dataplane.engine.structured import bitmask_layout

    engine = llm.engine
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiled = grammars.compile(("json_schema", SCHEMA)).result()
    first = engine.tokenizer.encode('{"items"', add_special_tokens=False)
    seqs = []
    for known in (first, None, []):
        grammar = None if known is None else Grammars.matcher(compiled)
        for t in known or []:
            grammar.accept(t)
        seqs.append(
            SimpleNamespace(grammar=grammar, output_token_ids=known or [], num_inflight=1, sample_row=0)
        )
    shape, cpu = (3, compiled.vocab.model_size), torch.device("cpu")
    words = bitmask_layout(compiled.vocab).words
    masks = GrammarMasks()
    own = masks.begin(shape, cpu, seqs, None, background=False)
    expected = own.host[:3].clone()
    into = torch.full((8, words), 7, dtype=torch.int32)
    begun = masks.begin(shape, cpu, seqs, None, background=True, into=into)
    assert masks.wait(begun) == [0, 2]
    assert torch.equal(into[[0, 2]], expected[[0, 2]])
    assert not torch.equal(into[0], into[2])  # two grammar states, two masks
    assert (into[1] == 7).all() and (into[3:] == 7).all()
    for bad in (torch.zeros(8, words + 1, dtype=torch.int32), torch.zeros(2, words, dtype=torch.int32)):
        with pytest.raises(ValueError, match="a bitmask buffer of"):
            masks.begin(shape, cpu, seqs, None, background=True, into=bad)
    grammars.close()


def test_a_constrained_step_dropped_before_its_finish_releases_its_wait_at_the_next_launch(llm):
    """A decode graph step's masked sampling waits on the device until released; a step the engine
    dropped before its finish (an error between its launch and its processing) would hold every step
    queued after it, plain ones too: the next launch releases it (ModelRunner.launch)."""
    from modelfleet.dataplane.kernels.host_signal import HostSignal, MaskReady

    runner = llm.engine.runner
    signal = HostSignal(torch.device("cpu"))
    dropped = MaskReady(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), signal, 1)
    runner._unfinished_head = dropped
    (out,) = llm.generate(["plain"], SamplingParams(max_tokens=2, temperature=0.0))
    assert out.token_ids and int(signal.host[0]) == 1 and runner._unfinished_head is None


@pytest.mark.parametrize("fails", [None, "end", "begin", "wait"])
def test_a_constrained_graph_step_queues_its_head_before_the_fill_and_leaves_no_wait_behind(fails):
    """ModelRunner._launch_graph_masked (a GPU's; here with stand-ins for its graphs, head and sampler):
    the forward is queued before the step before is ended (its fill waited for: the host's work of
    the launch overlaps it), and the masked head before this step's fill begins, so that every number
    released belongs to a wait queued; a step before that fails to end has its own wait released, a
    step whose fill cannot begin releases its wait at once, and one whose fill fails stays the
    runner's to release at its next launch (a finished one is not)."""
    from types import SimpleNamespace

    from modelfleet.dataplane.engine.model_runner import ModelRunner
    from modelfleet.dataplane.kernels.host_signal import HostSignal, MaskReady

    calls: list[str] = []
    signal = HostSignal(torch.device("cpu"))

    def fail_at(name):
        calls.append(name)
        if fails == name:
            raise RuntimeError(f"{name} failed")

    def ready(n):
        calls.append("ready")
        bits, flags = torch.zeros(n, 1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
        return MaskReady(bits, flags, signal, signal.queued + 1)

    def run(n):
        calls.append("run")
        signal.queue()
        return torch.zeros(n, 2, dtype=torch.long)

    head = SimpleNamespace(ready=ready, run=run)
    sampler = SimpleNamespace(
        fused_parameters=lambda seqs: (np.zeros(len(seqs), np.float32), np.zeros(len(seqs), np.int64)),
        begin_masks=lambda seqs, vocab_size, device, ready: fail_at("begin") or "begun",
        grammar_masks=SimpleNamespace(wait=lambda begun: fail_at("wait")),
        graph_sampled=lambda pairs, seqs: "sampled",
    )
    runner = SimpleNamespace(
        decode_graphs=SimpleNamespace(run=lambda inputs, batch_size, head: calls.append("forward")),
        sampler=sampler,
        _masked_head=lambda vocab: head,
        model_config=SimpleNamespace(vocab_size=16),
        device=torch.device("cpu"),
    )
    runner._end_previous = lambda end: ModelRunner._end_previous(runner, end)
    runner._replay_decode_graph = lambda *args, head: ModelRunner._replay_decode_graph(
        runner, *args, head=head
    )
    signal.queue()  # the step before's wait, unreleased until that step has ended
    runner._unfinished_head = MaskReady(torch.zeros(2, 1, dtype=torch.int32), None, signal, 1)

    def end_previous():
        fail_at("end")
        runner._unfinished_head = None  # as its finish does

    seqs = [SimpleNamespace(grammar=SimpleNamespace(vocab="vocab"), sample_row=None) for _ in range(2)]
    out = SimpleNamespace(scheduled=[SimpleNamespace(seq=seq) for seq in seqs])
    inputs = tuple(np.zeros(2, np.int64) for _ in range(7))
    if fails in ("end", "begin"):
        with pytest.raises(RuntimeError, match=f"{fails} failed"):
            ModelRunner._launch_graph_masked(runner, out, inputs, end_previous)
        assert calls == ["forward", "end", "ready", "run", "begin"][: 2 if fails == "end" else 5]
        assert int(signal.host[0]) == signal.queued and runner._unfinished_head is None
        return
    launched = ModelRunner._launch_graph_masked(runner, out, inputs, end_previous)
    assert calls == ["forward", "end", "ready", "run", "begin"] and [s.sample_row for s in seqs] == [0, 1]
    assert runner._unfinished_head.number == signal.queued and int(signal.host[0]) < signal.queued
    if fails == "wait":
        with pytest.raises(RuntimeError, match="wait failed"):
            launched.finish()
        assert runner._unfinished_head is not None  # the next launch releases it
    else:
        launched.finish()
        assert launched.sampled == "sampled" and runner._unfinished_head is None
    assert int(signal.host[0]) < signal.queued  # the runner released nothing it was not to


@pytest.mark.parametrize("tokens_queued", [True, False])
def test_a_decode_graph_step_ends_the_step_before_once_its_forward_is_queued(tokens_queued):
    """ModelRunner.launch (stand-ins for the graph paths): a decode graph's forward reads the step
    before's tokens on the device, so it is queued before that step is ended (its fill waited for) where
    that step's sampling is queued already; where it was left to that step's finish (an eager
    constrained step), the step before is ended first. Either way the launch's inputs are built first."""
    from types import SimpleNamespace

    from modelfleet.dataplane.engine.model_runner import ModelRunner

    calls: list[str] = []

    def graph_step(out, inputs, end_previous):
        calls.append("forward")
        runner._end_previous(end_previous)
        return "launched"

    runner = SimpleNamespace(
        block_size=4,
        decode_graphs=SimpleNamespace(max_batch=8, buffers={"block_tables": torch.zeros(8, 4)}),
        workers=None,
        _graph_samples=lambda out: True,
        _tokens_queued=tokens_queued,
        _unfinished_head=None,
        _launch_graph_sampled=graph_step,
    )
    runner._end_previous = lambda end: ModelRunner._end_previous(runner, end)
    seqs = [SimpleNamespace(token_ids=[1, 2, 3], block_ids=[0], sample_row=i, grammar=None) for i in range(2)]
    scheduled = [SimpleNamespace(seq=s, num_new_tokens=1, num_computed_tokens=3) for s in seqs]
    launched = ModelRunner.launch(runner, SimpleNamespace(scheduled=scheduled), lambda: calls.append("end"))
    assert launched == "launched" and runner._tokens_queued
    assert calls == (["forward", "end"] if tokens_queued else ["end", "forward"])


def test_a_masked_heads_flags_and_signal_follow_a_fill_in_the_engine(llm, monkeypatch):
    """With the matchers in the engine's process, a masked head's row flags are written when the step
    begins and its signal released once the fill (on the worker thread) has ended, or at once where no
    row is constrained any more (kernels/host_signal.py: the head waits on the device for it)."""
    from types import SimpleNamespace

    from modelfleet.dataplane.engine.structured import bitmask_layout
    from modelfleet.dataplane.kernels.host_signal import HostSignal, MaskReady

    engine = llm.engine
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiled = grammars.compile(("json_schema", SCHEMA)).result()
    seqs = [
        SimpleNamespace(grammar=g, output_token_ids=[], num_inflight=1, sample_row=0)
        for g in (Grammars.matcher(compiled), None, Grammars.matcher(compiled))
    ]
    words = bitmask_layout(compiled.vocab).words
    signal = HostSignal(torch.device("cpu"))
    ready = MaskReady(
        torch.full((4, words), 7, dtype=torch.int32), torch.full((4,), 7, dtype=torch.int32), signal, 1
    )
    masks = GrammarMasks()
    shape, cpu = (3, compiled.vocab.model_size), torch.device("cpu")
    begun = masks.begin(shape, cpu, seqs, None, background=True, ready=ready)
    assert ready.flags.tolist() == [1, 0, 1, 0]
    assert masks.wait(begun) == [0, 2] and int(signal.host[0]) == 1
    assert not (ready.bits[[0, 2]] == 7).all() and (ready.bits[[1, 3]] == 7).all()
    from modelfleet.dataplane.engine import structured

    monkeypatch.setattr(structured, "_follow_tokens", lambda seqs, previous: [])  # every grammar ended
    assert masks.begin(shape, cpu, seqs, None, background=True, ready=ready._replace(number=2)) is None
    assert int(signal.host[0]) == 2 and ready.flags.tolist() == [0, 0, 0, 0]
    grammars.close()
