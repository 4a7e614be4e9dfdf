"""AsyncLLM: streaming from the background engine thread, concurrency, bad input, cancel and abort."""

from __future__ import annotations

import asyncio

import pytest
from modelfleet.dataplane import AsyncLLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = AsyncLLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")
    yield llm
    llm.close()


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_idle(engine, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine did not go idle: {engine.stats()}")


async def test_streams_incremental_outputs_ending_with_finished(engine):
    outputs = await collect(engine, "Streaming works", SamplingParams(max_tokens=10, **GREEDY), "s1")
    # One output per step, unless outputs piled up while the consumer was busy: those come as one.
    assert len(outputs) >= 2 and all(o.new_token_ids for o in outputs)
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids and len(
        outputs[-1].token_ids
    ) == 10
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert not any(o.finished for o in outputs[:-1])
    assert "".join(o.new_text for o in outputs) == outputs[-1].text


async def test_concurrent_requests_match_offline_greedy(engine, tiny_model_dir):
    from modelfleet.dataplane import LLM

    prompts = ["one", "two two", "three three three", "four"]
    params = SamplingParams(max_tokens=8, **GREEDY)
    results = await asyncio.gather(*(collect(engine, p, params, f"c{i}") for i, p in enumerate(prompts)))
    offline = LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 21, dtype="float32", device="cpu")
    expected = [o.token_ids for o in offline.generate(prompts, params)]
    assert [r[-1].token_ids for r in results] == expected


async def test_bad_request_raises_before_any_output(engine):
    with pytest.raises(ValueError, match=r"^temperature:"):
        await collect(engine, "x", SamplingParams(temperature=-1), "bad1")
    with pytest.raises(ValueError, match=r"^prompt:"):
        await collect(engine, "", SamplingParams(), "bad2")
    with pytest.raises(ValueError, match=r"^prompt:"):
        await collect(engine, [1] * 300, SamplingParams(), "bad3")


async def test_closing_the_stream_aborts_and_frees_blocks(engine):
    stream = engine.generate(list(range(5, 90)), SamplingParams(max_tokens=200, **GREEDY), "cancelled")
    first = await stream.__anext__()
    assert not first.finished
    await stream.aclose()
    await wait_idle(engine)


async def test_cancelled_task_aborts(engine):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=200, **GREEDY), "task"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)


async def test_abort_ends_the_stream_with_abort(engine):
    outputs = []
    async for out in engine.generate([8, 9], SamplingParams(max_tokens=200, **GREEDY), "aborted"):
        outputs.append(out)
        if len(outputs) == 3:
            await engine.abort("aborted")
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs[-1].token_ids) < 200
    await wait_idle(engine)


async def test_duplicate_request_id_is_refused(engine):
    stream = engine.generate([1, 2], SamplingParams(max_tokens=50, **GREEDY), "dup")
    await stream.__anext__()
    with pytest.raises(ValueError, match=r"^request_id:"):
        await collect(engine, [1, 2], SamplingParams(max_tokens=2), "dup")
    await stream.aclose()
    await wait_idle(engine)


async def test_close_ends_streams_in_flight(tiny_model_dir):
    llm = AsyncLLM(tiny_model_dir, max_model_len=128, kv_cache_bytes=1 << 20, dtype="float32", device="cpu")
    stream = llm.generate([4, 5, 6], SamplingParams(max_tokens=120, **GREEDY), "open")
    await stream.__anext__()
    await asyncio.get_running_loop().run_in_executor(None, llm.close)
    with pytest.raises(RuntimeError, match="closed"):
        async for _ in stream:
            pass
    with pytest.raises(RuntimeError, match="closed"):
        await collect(llm, [1], SamplingParams(max_tokens=1), "late")


async def test_one_event_loop_wake_up_per_step_for_all_streams(engine):
    """A step's outputs for every stream reach the event loop in one callback (before: one per stream
    and step, each a self-pipe write the loop had to wake for)."""
    loop = asyncio.get_running_loop()
    wakeups: list[int] = []
    steps_with_outputs: list[int] = []
    original_step = engine.engine.step

    def counted_step():
        outputs = original_step()
        if outputs:
            steps_with_outputs.append(len(outputs))
        return outputs

    def counted_call(callback, *args, **kwargs):
        wakeups.append(1)
        return type(loop).call_soon_threadsafe(loop, callback, *args, **kwargs)

    engine.engine.step = counted_step
    loop.call_soon_threadsafe = counted_call
    try:
        params = SamplingParams(max_tokens=6, **GREEDY)
        results = await asyncio.gather(*(collect(engine, f"wake {i}", params, f"w{i}") for i in range(4)))
    finally:
        del loop.call_soon_threadsafe
        engine.engine.step = original_step
    assert all(len(outputs[-1].token_ids) == 6 for outputs in results)
    assert max(steps_with_outputs) > 1  # several streams shared steps
    assert len(wakeups) == len(steps_with_outputs) < sum(steps_with_outputs)


@pytest.mark.parametrize("delta", [True, False])
def test_a_pile_of_outputs_merges_as_followed_by_does(delta):
    """Outputs that piled up while the consumer was busy become one, built once; it says exactly what
    the outputs chained by `followed_by` say."""
    import functools

    from modelfleet.dataplane.engine.outputs import RequestOutput
    from modelfleet.dataplane.engine.threaded import merged

    pile, text, ids = [], "", []
    for step in range(5):
        ids.append(10 + step)
        text += f" t{step}"
        new_ids, lp = [10 + step], [{10 + step: -0.5 * step}]
        pile.append(
            RequestOutput(
                "r", [] if delta else [1, 2], f" t{step}" if delta else text,
                list(new_ids) if delta else list(ids), f" t{step}", new_ids, lp if delta else None,
                finish_reason="length" if step == 4 else None, finished=step == 4, delta=delta,
            )
        )  # fmt: skip
    chained = functools.reduce(lambda a, b: a.followed_by(b), pile)
    assert merged(pile) == chained
    assert merged(pile).new_token_ids == [10, 11, 12, 13, 14] and merged(pile).new_text == text
    assert merged(pile[:1]) is pile[0]
