"""stream_outputs: a request's outputs in order; those that piled up come as one; errors and early exits."""

from __future__ import annotations

import asyncio

import pytest
from modelfleet.dataplane.engine.outputs import RequestOutput
from modelfleet.dataplane.engine.threaded import stream_outputs


def output(tokens: list[int], new: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt_token_ids=[1],
        text="".join(f" t{t}" for t in tokens),
        token_ids=tokens,
        new_text="".join(f" t{t}" for t in new),
        new_token_ids=new,
        finished=finished,
        finish_reason="length" if finished else None,
    )


async def test_outputs_that_piled_up_come_as_one_with_both_deltas():
    queue: asyncio.Queue = asyncio.Queue()
    for n in (1, 2, 3):
        queue.put_nowait(output(list(range(1, n + 1)), [n]))
    queue.put_nowait(output([1, 2, 3, 4], [4], finished=True))
    abandoned: list[str] = []
    got = [o async for o in stream_outputs(queue, lambda: abandoned.append("r"))]
    (merged,) = got
    assert merged.new_token_ids == [1, 2, 3, 4] and merged.new_text == " t1 t2 t3 t4"
    assert merged.token_ids == [1, 2, 3, 4] and merged.finished and merged.finish_reason == "length"
    assert not abandoned


async def test_delta_outputs_that_piled_up_come_as_one_holding_both():
    queue: asyncio.Queue = asyncio.Queue()
    for n, finished in ((1, False), (2, True)):
        delta = output([n], [n], finished)
        delta.prompt_token_ids, delta.logprobs, delta.delta = [], [{n: -0.5}], True
        queue.put_nowait(delta)
    (merged,) = [o async for o in stream_outputs(queue, lambda: None)]
    assert merged.delta and merged.finished
    assert merged.token_ids == merged.new_token_ids == [1, 2] and merged.text == merged.new_text == " t1 t2"
    assert merged.logprobs == [{1: -0.5}, {2: -0.5}]


async def test_outputs_arriving_one_at_a_time_stay_one_at_a_time():
    queue: asyncio.Queue = asyncio.Queue()

    async def produce():
        for n in (1, 2, 3):
            queue.put_nowait(output(list(range(1, n + 1)), [n], finished=n == 3))
            await asyncio.sleep(0.01)

    producer = asyncio.create_task(produce())
    got = [o async for o in stream_outputs(queue, lambda: None)]
    await producer
    assert [o.new_token_ids for o in got] == [[1], [2], [3]]


async def test_an_error_after_piled_up_outputs_comes_after_them():
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(output([1], [1]))
    queue.put_nowait(output([1, 2], [2]))
    queue.put_nowait(RuntimeError("engine step failed"))
    seen: list[RequestOutput] = []
    with pytest.raises(RuntimeError, match="engine step failed"):
        async for o in stream_outputs(queue, lambda: None):
            seen.append(o)
    assert [o.new_token_ids for o in seen] == [[1, 2]]


async def test_leaving_early_abandons_the_request():
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(output([1], [1]))
    abandoned: list[str] = []
    stream = stream_outputs(queue, lambda: abandoned.append("r"))
    assert (await anext(stream)).new_token_ids == [1]
    await stream.aclose()
    assert abandoned == ["r"]
