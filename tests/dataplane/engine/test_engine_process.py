"""AsyncLLMProcess: the engine in a child process gives AsyncLLM's streams, refusals, aborts and errors."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess, EngineProcessError
from modelfleet.dataplane.engine.stream_relay import Drop

GREEDY = dict(temperature=0.0, ignore_eos=True)
SETTINGS = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = AsyncLLMProcess(tiny_model_dir, **SETTINGS)
    yield engine
    engine.close()


async def collect(engine, prompt, params, request_id=None):
    return [o async for o in engine.generate(prompt, params, request_id=request_id)]


async def test_streams_equal_the_in_process_engine(engine, tiny_model_dir):
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompts = ["Once upon a time", [5, 6, 7, 8]]
    streams = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
    expected = LLM(tiny_model_dir, **SETTINGS).generate(prompts, params)
    for outputs, want in zip(streams, expected, strict=True):
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert outputs[-1].token_ids == want.token_ids and outputs[-1].text == want.text
        assert [t for o in outputs for t in o.new_token_ids] == want.token_ids
        assert "".join(o.new_text for o in outputs) == want.text
    assert engine.stats().num_total_blocks > 0


async def test_bad_requests_are_refused_in_the_caller(engine):
    with pytest.raises(ValueError, match="prompt"):
        await collect(engine, [], SamplingParams())
    with pytest.raises(ValueError, match="maximum length"):
        await collect(engine, list(range(5, 200)), SamplingParams())


async def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(engine):
    stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=100, **GREEDY), request_id="leaving")
    first = await anext(stream)
    assert not first.finished
    await stream.aclose()
    for _ in range(100):
        await asyncio.sleep(0.05)
        await collect(engine, [9], SamplingParams(max_tokens=1, **GREEDY))  # brings fresh stats
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            break
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_model_that_cannot_load_fails_the_constructor(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"], "model_type": "nope"}')
    with pytest.raises(EngineProcessError, match="could not start"):
        AsyncLLMProcess(tmp_path, device="cpu")


async def test_a_crashed_engine_process_ends_the_open_streams(tiny_model_dir):
    engine = AsyncLLMProcess(tiny_model_dir, **SETTINGS)
    try:
        stream = engine.generate([5, 6], SamplingParams(max_tokens=100, **GREEDY))
        await anext(stream)
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match="exited"):
            async for _ in stream:
                pass
        assert engine.failure and "exited" in engine.failure
        with pytest.raises(RuntimeError, match="exited"):  # at once, not a request left hanging
            await asyncio.wait_for(collect(engine, [5, 6], SamplingParams(max_tokens=2)), timeout=10)
    finally:
        engine.close()


def test_closing_never_closes_a_pipe_under_a_send(tiny_model_dir):
    """A stream that ends as its engine is closed (the engine died, the version was retired) still
    sends its relay a Drop. Had the close closed the relay's pipe under that send, the descriptor's
    number could by then be a new client connection's, and the Drop's bytes its request's: the close
    waits for sends in flight, and ends the pipe by a shutdown that wakes its reader."""
    engine = AsyncLLMProcess(tiny_model_dir, stream_relays=1, **SETTINGS)
    link = engine._relays[0]
    closer = threading.Thread(target=engine.close)
    with link.lock:  # a send in flight
        closer.start()
        closer.join(timeout=2)
        assert closer.is_alive() and not link.conn.closed
    closer.join(timeout=30)
    assert not closer.is_alive() and link.conn.closed and engine._conn.closed
    assert not link.process.is_alive() and link.reader is not None and not link.reader.is_alive()
    assert not link.send(Drop("late"))  # a send after the close is refused, not written anywhere
