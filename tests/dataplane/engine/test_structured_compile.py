"""Grammar compilation runs on a worker thread, never on the engine's: a request whose grammar is still
compiling waits outside the scheduler while the other requests keep stepping, and joins once it is
ready. A schema that cannot be compiled fails only its own request. The compile is held back by an
event here, so every check is on order and progress, none on time."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.async_llm import AsyncLLM
from modelfleet.dataplane.engine.structured import Grammars

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]})


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")


@pytest.fixture
def held_compile(monkeypatch):
    """Compiles wait for `release` (set on teardown so no worker is left blocked); `started` is set once
    the worker has begun."""
    release, started = threading.Event(), threading.Event()
    compile_ = Grammars._compile

    def slow(self, structured):
        started.set()
        assert release.wait(timeout=60), "the test never released the compile"
        return compile_(self, structured)

    monkeypatch.setattr(Grammars, "_compile", slow)
    yield release, started
    release.set()


def _fresh_schema(tag: str) -> tuple[str, str]:
    """A schema no earlier test compiled (the cache would answer at once)."""
    return (
        "json_schema",
        json.dumps({"type": "object", "properties": {tag: {"enum": ["x", "y"]}}, "required": [tag]}),
    )


def test_a_slow_compile_does_not_hold_back_other_requests(llm, held_compile):
    release, started = held_compile
    engine = llm.engine
    structured = _fresh_schema("slow")
    engine.add_request("constrained", "one", SamplingParams(max_tokens=40, structured=structured, seed=3))
    engine.add_request("plain", "two", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert started.wait(timeout=60)
    finished: dict[str, object] = {}
    while "plain" not in finished:
        for out in engine.step():
            assert out.request_id == "plain", "the constrained request ran before its grammar was ready"
            if out.finished:
                finished[out.request_id] = out
    # The plain request ran to its end while the grammar was still compiling.
    assert len(finished["plain"].token_ids) == 6
    assert engine.stats().num_waiting == 1 and engine.has_unfinished_requests()
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["constrained"].finish_reason == "stop"
    assert json.loads(finished["constrained"].text)["slow"] in ("x", "y")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_one_compile_per_schema(llm, monkeypatch):
    calls = []
    compile_ = Grammars._compile

    def counted(self, structured):
        calls.append(structured)
        return compile_(self, structured)

    monkeypatch.setattr(Grammars, "_compile", counted)
    structured = _fresh_schema("cached")
    params = SamplingParams(max_tokens=30, structured=structured, seed=1)
    outs = llm.generate(["a", "b", "c"], params)
    assert all(json.loads(o.text)["cached"] in ("x", "y") for o in outs)
    llm.generate("d", params)
    assert calls == [structured]


def test_an_aborted_request_waiting_for_its_grammar_ends_cleanly(llm, held_compile):
    release, started = held_compile
    engine = llm.engine
    engine.add_request("gone", "one", SamplingParams(max_tokens=10, structured=_fresh_schema("abort")))
    assert started.wait(timeout=60)
    out = engine.abort("gone")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    release.set()
    assert engine.step() == []  # the grammar that arrives late finds no one waiting for it


def test_a_bad_schema_is_refused_before_anything_is_queued(llm):
    engine = llm.engine
    engine.add_request("plain", "two", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match="response_format: the JSON schema cannot be compiled"):
        engine.add_request("bad", "x", SamplingParams(structured=("json_schema", '{"type": "nonsense"}')))
    assert engine.stats().num_waiting == 1  # the plain request alone
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.token_ids)) for o in outs] == [("plain", 5)]


def test_a_compile_failing_on_the_worker_fails_its_request_alone(llm, monkeypatch):
    def broken(self, structured):
        raise ValueError("response_format: the JSON schema cannot be compiled: out of states")

    monkeypatch.setattr(Grammars, "_compile", broken)
    constrained = SamplingParams(max_tokens=10, structured=_fresh_schema("broken"))
    plain = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    engine = llm.engine
    engine.add_request("plain", "two", plain)
    # The worker may fail it before add_request returns (a ValueError there) or after (an error output).
    try:
        engine.add_request("constrained", "one", constrained)
    except ValueError as exc:
        assert "out of states" in str(exc)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(outs["plain"].token_ids) == 7 and outs["plain"].finish_reason == "length"
    if "constrained" in outs:
        assert outs["constrained"].finish_reason == "error" and "out of states" in outs["constrained"].error
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_engine_thread_streams_while_a_grammar_compiles(tiny_model_dir, held_compile):
    release, started = held_compile
    llm = AsyncLLM(tiny_model_dir, max_model_len=128, kv_cache_bytes=1 << 20, dtype="float32", device="cpu")

    async def main() -> None:
        order: list[str] = []

        async def run(name: str, params: SamplingParams) -> str:
            text = ""
            async for out in llm.generate("hello", params, request_id=name):
                text = out.text
            order.append(name)
            return text

        constrained = asyncio.create_task(
            run("constrained", SamplingParams(max_tokens=40, structured=_fresh_schema("thread"), seed=2))
        )
        await asyncio.to_thread(started.wait, 60)
        await run("plain", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert order == ["plain"] and not constrained.done()
        release.set()
        assert json.loads(await constrained)["thread"] in ("x", "y")
        assert order == ["plain", "constrained"]

    try:
        asyncio.run(main())
    finally:
        llm.close()


def test_ignore_eos_is_refused_with_a_grammar(llm):
    """A grammar ends its output with its JSON; past that end no token is valid, so the two conflict."""
    with pytest.raises(ValueError, match=r"^ignore_eos: cannot be combined with structured output"):
        SamplingParams(max_tokens=60, ignore_eos=True, structured=("json_schema", SCHEMA))


def test_a_terminated_grammar_masks_nothing(llm):
    """A matcher that has accepted its end is left alone by the sampler's mask (it would raise)."""
    import torch
    from modelfleet.dataplane.engine.structured import GrammarMasks, GrammarVocab

    class Done:
        def is_terminated(self) -> bool:
            return True

    class Filler:
        def batch_fill_next_token_bitmask(self, matchers, bitmask, indices) -> None:
            raise AssertionError("a terminated matcher was asked for a mask")

    class Grammar:
        matcher = handle = Done()  # handle: the matcher's native object, which _follow_tokens reads
        num_accepted, vocab = 0, GrammarVocab(32, 32)

    class Seq:
        grammar, output_token_ids, num_inflight = Grammar(), [], 1

    masks = GrammarMasks()
    masks._filler = Filler()
    logits = torch.zeros(1, 32)
    assert torch.equal(masks.apply(logits, [Seq()], None), torch.zeros(1, 32))


def test_a_schema_is_parsed_once_and_a_bad_one_fails_every_time(monkeypatch):
    """check_structured (the server's check of each request) parses a schema once; a schema that does
    not parse gives its error to every request that sends it."""
    import xgrammar
    from modelfleet.dataplane.engine import structured

    structured._parse_schema.cache_clear()
    parsed: list[str] = []
    parse = xgrammar.Grammar.from_json_schema
    monkeypatch.setattr(
        xgrammar.Grammar, "from_json_schema", lambda s, **kw: parsed.append(s) or parse(s, **kw)
    )
    good = ("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}}')
    for _ in range(3):
        structured.check_structured(good, tokenizer=object())
    assert parsed == [good[1]]
    bad = ("json_schema", '{"type": "object", "properties": {"n": {"type": "no-such-type"}}}')
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^response_format: the JSON schema cannot be compiled"):
            structured.check_structured(bad, tokenizer=object())
    assert parsed == [good[1], bad[1], bad[1]]
