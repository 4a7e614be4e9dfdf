"""A GPU engine's grammars in a process of their own (engine/grammar_process.py): the engine's steps and
the process together give the tokens of grammars held in the engine's process, keep the overlap, close
every sequence's matcher, and turn the process's errors and its end into failed steps (and another
process for the next constrained request). Run on the CPU, where the engine's grammars would otherwise
stay in its process: the process is started as a GPU engine starts it."""

from __future__ import annotations

import gc
import json
import time
from types import SimpleNamespace

import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.grammar_process import GrammarProcess
from modelfleet.dataplane.engine.shared_host import place_of, shared_bytes
from modelfleet.dataplane.engine.structured import GrammarMasks, Grammars, RemoteGrammar, bitmask_layout

from .test_structured_masks import SCHEMA, allowed_throughout, batch, check_overlap_and_tokens


def make_llm(model_dir, *, in_process: bool) -> LLM:
    llm = LLM(model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")
    if in_process:
        engine = llm.engine
        engine._grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
        engine._grammars.start_process(1)
    return llm


@pytest.fixture
def remote(tiny_model_dir):
    llm = make_llm(tiny_model_dir, in_process=True)
    # Compiled before the first request, as a served schema is after its first: else the requests wait
    # for the process to start (imports, ~1-2 s here) while the others step alone.
    for structured in {p.structured for p in batch()[1]} - {None}:
        llm.engine._grammars.compile(structured).result(timeout=60)
    yield llm
    llm.engine._grammars.close()


def test_the_grammar_process_gives_the_tokens_of_grammars_in_the_engine(tiny_model_dir, remote, monkeypatch):
    prompts, params = batch()
    expected = make_llm(tiny_model_dir, in_process=False).generate(prompts, params)
    opened, released = [], []
    monkeypatch.setattr(
        GrammarProcess,
        "open",
        lambda self, schema, f=GrammarProcess.open: opened.append(1) or f(self, schema),
    )
    monkeypatch.setattr(
        GrammarProcess,
        "release",
        lambda self, slot, f=GrammarProcess.release: released.append(slot) or f(self, slot),
    )
    got = remote.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    gc.collect()
    assert len(opened) == 3 and sorted(released) == sorted(set(released)) and len(released) == 3
    # The matchers' sequences ended: the next step's message closes them in the process (no error there).
    (out,) = remote.generate(["again"], params[0])
    assert allowed_throughout(remote, params[0].structured, out.token_ids)


def test_the_grammar_process_keeps_the_overlap_and_its_tokens(remote, monkeypatch):
    check_overlap_and_tokens(remote, monkeypatch)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_the_bitmask_comes_into_a_buffer_of_the_callers(remote, shared):
    """As with matchers in the engine (test_the_bitmask_fills_into_a_buffer_of_the_callers): the rows a
    grammar constrains filled, in place, the others left as they were; which rows, known at the wait.
    A buffer in shared memory (a decode graph's input mirror) is filled by the process itself; another
    is copied into from the process's own."""
    from types import SimpleNamespace

    engine = remote.engine
    structured = ("json_schema", SCHEMA)
    schema = engine._grammars.compile(structured).result()
    local = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiled = local.compile(structured).result()
    first = engine.tokenizer.encode('{"items"', add_special_tokens=False)
    ours, theirs = [], []
    for known in (first, None, []):
        for made, made_from in ((ours, schema), (theirs, compiled)):
            grammar = None if known is None else Grammars.matcher(made_from)
            made.append(
                SimpleNamespace(grammar=grammar, output_token_ids=known or [], num_inflight=1, sample_row=0)
            )
    # Both follow the known tokens as a row behind would (num_inflight 1: no token in flight).
    shape, cpu = (3, schema.vocab.model_size), torch.device("cpu")
    words = bitmask_layout(schema.vocab).words
    expected = GrammarMasks().begin(shape, cpu, theirs, None, background=False).host[:3].clone()
    if shared:
        into = shared_bytes(8 * words * 4, pinned=False).view(torch.int32).view(8, words)
        into.fill_(7)
    else:
        into = torch.full((8, words), 7, dtype=torch.int32)
    masks = GrammarMasks()
    begun = masks.begin(shape, cpu, ours, None, background=True, into=into)
    assert isinstance(ours[0].grammar, RemoteGrammar) and begun.rows == []  # known at the wait
    assert masks.wait(begun) == [0, 2]
    assert torch.equal(into[[0, 2]], expected[[0, 2]])
    assert not torch.equal(into[0], into[2])
    assert (into[1] == 7).all() and (into[3:] == 7).all()
    process = engine._grammars._process
    in_place = any(place == place_of(into) for place, _, _ in process._targets)
    assert in_place == shared  # filled in place, else in its own and copied
    local.close()


def head_mirror(rows: int, words: int, *, shared: bool):
    """A masked head's inputs as MaskedHeadGraphs lays them out: row flags, then the bitmask, in one
    buffer (shared memory, or the process's own), and its signal; all filled with 7."""
    from modelfleet.dataplane.kernels.host_signal import HostSignal, MaskReady

    nbytes = rows * (1 + words) * 4
    memory = shared_bytes(nbytes, pinned=False) if shared else torch.empty(nbytes, dtype=torch.uint8)
    values = memory.view(torch.int32)
    values.fill_(7)
    signal = HostSignal(torch.device("cpu"))
    return MaskReady(values[rows:].view(rows, words), values[:rows], signal, signal.queue())


def constrained_rows(remote):
    """Three rows of SCHEMA's matchers in the engine's grammar process: the first four tokens of an
    answer followed, none (an unconstrained row), a fresh matcher."""
    from types import SimpleNamespace

    engine = remote.engine
    schema = engine._grammars.compile(("json_schema", SCHEMA)).result()
    first = engine.tokenizer.encode('{"items"', add_special_tokens=False)
    return schema.vocab, [
        SimpleNamespace(
            grammar=None if known is None else Grammars.matcher(schema),
            output_token_ids=known or [],
            num_inflight=1,
            sample_row=0,
        )
        for known in (first, None, [])
    ]


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_a_masked_heads_flags_and_signal_follow_the_fill(remote, shared):
    """A decode graph's masked head waits on the device for its signal and then copies the bitmask and
    row flags (MaskedHeadGraphs): the process writes the bitmask, the flags (the constrained rows among
    the step's, none past them) and then the signal itself where all three lie in shared memory, with no
    wait by the engine; elsewhere the engine writes them when it ends the step."""
    vocab, seqs = constrained_rows(remote)
    rows, words = 8, bitmask_layout(vocab).words
    ready = head_mirror(rows, words, shared=shared)
    masks = GrammarMasks()
    begun = masks.begin((3, vocab.model_size), torch.device("cpu"), seqs, None, background=True, ready=ready)
    signal = ready.signal.host
    if shared:
        deadline = time.monotonic() + 30
        while int(signal[0]) < ready.number and time.monotonic() < deadline:
            time.sleep(0.001)
        assert int(signal[0]) == ready.number  # released before the engine ends the step
        assert ready.flags.tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    else:
        time.sleep(0.2)
        assert int(signal[0]) < ready.number and (ready.flags == 7).all()  # the process cannot write them
    assert masks.wait(begun) == [0, 2]
    assert int(signal[0]) == ready.number and ready.flags.tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    assert not (ready.bits[[0, 2]] == 7).all() and (ready.bits[[1, *range(3, rows)]] == 7).all()


def test_an_error_in_the_process_releases_the_masked_heads_wait(remote):
    """A step the process fails still has its masked head's wait released there (the step's tokens are
    dropped with it); one the process never ends (it died) is left to the runner, which releases it at
    its next launch (test_structured_masks)."""
    vocab, seqs = constrained_rows(remote)
    process = remote.engine._grammars._process
    words = bitmask_layout(vocab).words
    ready = head_mirror(8, words, shared=True)
    stray = [
        SimpleNamespace(grammar=RemoteGrammar(process, 10**6, vocab), output_token_ids=[5], num_inflight=1)
    ]
    masks = GrammarMasks()
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="no matcher in slot 1000000"):
        masks.begin((1, vocab.model_size), cpu, stray, None, background=False, ready=ready)
    stray[0].grammar.process = SimpleNamespace(release=lambda slot: None)  # never opened
    assert int(ready.signal.host[0]) == ready.number
    ready = ready._replace(number=ready.signal.queue())
    begun = masks.begin((3, vocab.model_size), cpu, seqs, None, background=True, ready=ready)
    process._process.kill()
    process._process.wait()
    with pytest.raises(RuntimeError, match="the grammar process ended"):
        masks.wait(begun)


def test_an_error_in_the_process_fails_its_step_alone(remote):
    """A step the process cannot carry out (here a matcher it never opened) is a RuntimeError with the
    process's own message; the process serves the next step."""
    from types import SimpleNamespace

    process = remote.engine._grammars._process
    vocab = process.vocab
    stray = RemoteGrammar(process, 10**6, vocab)
    seqs = [SimpleNamespace(grammar=stray, output_token_ids=[5], num_inflight=1, sample_row=0)]
    masks = GrammarMasks()
    with pytest.raises(RuntimeError, match=r"^structured output: ValueError: no matcher in slot 1000000 "):
        masks.begin((1, vocab.model_size), torch.device("cpu"), seqs, None, background=False)
    stray.process = SimpleNamespace(release=lambda slot: None)  # never opened: nothing to close
    structured = ("json_schema", SCHEMA)
    (out,) = remote.generate(["one"], SamplingParams(max_tokens=24, temperature=0.0, structured=structured))
    assert out.error is None and allowed_throughout(remote, structured, out.token_ids)


def test_a_process_that_ended_fails_the_step_and_the_next_request_gets_another(remote):
    engine = remote.engine
    structured = ("json_schema", SCHEMA)
    params = SamplingParams(max_tokens=30, temperature=0.0, structured=structured)
    engine.add_request("a", "one", params)
    for _ in range(3):
        engine.step()
    first = engine._grammars._process
    first._process.kill()
    first._process.wait()
    with pytest.raises(RuntimeError, match=r"the grammar process ended \(exit code -9\)"):
        for _ in range(2):
            engine.step()
    engine.abort("a")  # as the engine process does after a failed step
    while engine.has_unfinished_requests() or engine._launched is not None:
        engine.step()
    (out,) = remote.generate(["two"], params)
    assert engine._grammars._process is not first and engine._grammars._process.alive
    assert out.error is None and allowed_throughout(remote, structured, out.token_ids)


def test_a_compile_error_in_the_process_is_the_requests_own(remote):
    """A schema the process's compiler refuses fails its request with the compile's ValueError, as in the
    engine's process (the schema parses on the caller's side: only the compile refuses it here)."""
    engine = remote.engine
    future = engine._grammars._process.compile(
        ("json_schema", json.dumps({"type": "object", "minProperties": "x"}))
    )
    with pytest.raises(ValueError, match="response_format: the JSON schema cannot be compiled"):
        future.result(timeout=30)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_split_fill_fills_what_one_filler_would(tiny_model_dir, threads):
    """The process's fill shared out over threads (each every threads-th row) gives each row the mask one
    filler gives it, leaves the other rows alone, with fewer rows than threads too; a filler's error on
    another thread is raised by the fill."""
    import xgrammar
    from modelfleet.dataplane.engine.grammar_process import _SplitFill

    llm = make_llm(tiny_model_dir, in_process=False)
    engine = llm.engine
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiled = grammars.compile(("json_schema", SCHEMA)).result()
    answer = engine.tokenizer.encode('{"items": ["ab", "cd"], "n": 7}', add_special_tokens=False)
    matchers = []
    for length in (0, 1, 3, 4, 6, 8):  # six grammar states
        grammar = Grammars.matcher(compiled)
        for t in answer[:length]:
            grammar.accept(t)
        matchers.append(grammar.matcher)
    words = bitmask_layout(compiled.vocab).words
    rows = [0, 2, 3, 5, 6, 7]
    expected = torch.full((9, words), 7, dtype=torch.int32)
    one = xgrammar.BatchGrammarMatcher(max_threads=1)
    one.batch_fill_next_token_bitmask(matchers, expected, indices=rows)
    fill = _SplitFill(xgrammar, threads)
    for _ in range(2):  # the threads serve step after step
        bitmask = torch.full((9, words), 7, dtype=torch.int32)
        fill(matchers, bitmask, rows)
        assert torch.equal(bitmask, expected)
    bitmask = torch.full((9, words), 7, dtype=torch.int32)
    fill(matchers[2:3], bitmask, [3])  # one row, however many threads
    assert torch.equal(bitmask[3], expected[3]) and (bitmask[[0, 1, 2, 4, 5, 6, 7, 8]] == 7).all()
    with pytest.raises(AttributeError, match="_handle"):  # xgrammar's, for what is not a matcher
        fill([*matchers[:-1], object()], bitmask, rows)
    fill(matchers, bitmask, rows)  # and serves on
    assert torch.equal(bitmask, expected)
    grammars.close()


def test_without_shared_memory_the_grammars_stay_in_the_engines_process(tiny_model_dir, monkeypatch, caplog):
    """A host where no shared memory can be made (no /dev/shm): the engine starts with its grammars in
    its own process, says so, and serves constrained requests as before."""
    from modelfleet.dataplane.engine import grammar_process
    from modelfleet.dataplane.engine.model_runner import ModelRunner

    def no_shared_memory(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "/dev/shm")

    monkeypatch.setattr(grammar_process, "shared_bytes", no_shared_memory)
    monkeypatch.setattr(ModelRunner, "samples_in_graphs", property(lambda self: True))
    monkeypatch.setattr(ModelRunner, "prepare_structured", lambda self, vocab: None)
    llm = LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")
    assert llm.engine._grammars._process is None
    assert "the grammars stay in the engine's process" in caplog.text
    structured = ("json_schema", SCHEMA)
    (out,) = llm.generate(["one"], SamplingParams(max_tokens=16, temperature=0.0, structured=structured))
    assert out.token_ids and allowed_throughout(llm, structured, out.token_ids)


def test_a_step_dropped_before_its_wait_takes_its_reply_and_error_with_it(remote):
    """A step begun and never waited for (the engine dropped it): the next step reads past its reply,
    and past its error, and gets its own."""
    from types import SimpleNamespace

    engine = remote.engine
    schema = engine._grammars.compile(("json_schema", SCHEMA)).result()
    vocab = schema.vocab
    good = [
        SimpleNamespace(grammar=Grammars.matcher(schema), output_token_ids=[], num_inflight=1, sample_row=0)
    ]
    stray = RemoteGrammar(schema.process, 10**6, vocab)
    bad = [SimpleNamespace(grammar=stray, output_token_ids=[], num_inflight=1, sample_row=0)]
    masks, shape, cpu = GrammarMasks(), (1, vocab.model_size), torch.device("cpu")
    masks.begin(shape, cpu, bad, None, background=True)  # fails in the process; never waited for
    masks.begin(shape, cpu, good, None, background=True)  # dropped too
    begun = masks.begin(shape, cpu, good, None, background=True)
    assert masks.wait(begun) == [0]
    stray.process = SimpleNamespace(release=lambda slot: None)  # never opened: nothing to close


def test_the_samplers_own_bitmask_is_filled_in_place_too(remote):
    """A step sampled outside a decode graph (a prefill's) has the grammars fill the sampler's own host
    bitmask: in shared memory, filled by the process itself, with no copy."""
    from types import SimpleNamespace

    schema = remote.engine._grammars.compile(("json_schema", SCHEMA)).result()
    seqs = [
        SimpleNamespace(grammar=Grammars.matcher(schema), output_token_ids=[], num_inflight=1, sample_row=0)
    ]
    masks = GrammarMasks()
    begun = masks.begin((1, schema.vocab.model_size), torch.device("cpu"), seqs, None, background=True)
    assert (place_of(begun.host), None, None) in schema.process._targets and schema.process._copy_from is None
    assert masks.wait(begun) == [0] and begun.host[0].any()


def test_a_bad_grammars_setting_stops_an_engine_at_its_start(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MODELFLEET_GRAMMARS", "threads")
    with pytest.raises(ValueError, match="MODELFLEET_GRAMMARS: 'threads' must be 'process' or 'thread'"):
        make_llm(tiny_model_dir, in_process=False)


def test_ctrl_c_leaves_the_grammar_process_to_its_engine(remote):
    """Ctrl-C reaches every process of the terminal's group: the grammar process ignores it (the server
    stops, and its engine's close ends the process), and serves on meanwhile."""
    import signal

    process = remote.engine._grammars._process
    process._process.send_signal(signal.SIGINT)
    structured = ("json_schema", SCHEMA)
    (out,) = remote.generate(["one"], SamplingParams(max_tokens=12, temperature=0.0, structured=structured))
    assert out.error is None and process.alive
    process.close()
    assert not process.alive and process._process.returncode == 0
