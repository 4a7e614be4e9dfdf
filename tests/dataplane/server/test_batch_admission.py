"""Every sequence of a request counts: in admission (a place per prompt and choice) and against the key's
tokens per minute (prompt plus max_tokens per sequence, before anything runs)."""

from __future__ import annotations

import asyncio

import pytest
from modelfleet.dataplane.server.admission import AdmissionQueue
from modelfleet.dataplane.server.auth import KeyLimits, Principal, RateLimiter
from modelfleet.dataplane.server.dataplane import RequestContext
from modelfleet.dataplane.server.errors import BadRequest, RateLimited
from modelfleet.dataplane.server.protocol import CompletionRequest
from modelfleet.dataplane.server.slots import Slots

from .test_auth import FakeClock
from .test_dataplane import dataplane  # noqa: F401  (the fixture: a facade over a scripted engine)


async def test_a_batch_takes_a_place_per_sequence():
    gate = AdmissionQueue(max_running=4, max_waiting=8)
    release = asyncio.Event()

    async def hold(sequences: int) -> None:
        async with gate.admit(sequences):
            await release.wait()

    big = asyncio.create_task(hold(3))
    await asyncio.sleep(0)
    small = asyncio.create_task(hold(2))  # 3 + 2 > 4: waits
    await asyncio.sleep(0)
    assert (gate.running, gate.waiting) == (3, 1)
    release.set()
    await asyncio.gather(big, small)
    assert (gate.running, gate.waiting) == (0, 0)


async def test_a_batch_larger_than_the_gate_takes_all_of_it():
    gate = AdmissionQueue(max_running=4, max_waiting=8)
    async with gate.admit(100):
        assert gate.running == 4


async def test_slots_are_granted_in_arrival_order_and_a_cancelled_waiter_gives_way():
    slots = Slots(4)
    await slots.acquire(3)
    order: list[str] = []

    async def take(name: str, weight: int) -> None:
        await slots.acquire(weight)
        order.append(name)

    large = asyncio.create_task(take("large", 4))
    await asyncio.sleep(0)
    small = asyncio.create_task(take("small", 1))  # would fit now, but must not overtake `large`
    await asyncio.sleep(0)
    assert order == []
    large.cancel()
    for _ in range(3):  # the cancellation, then the grant, then `small` runs
        await asyncio.sleep(0)
    assert order == ["small"] and slots.free == 0
    slots.release(3)
    slots.release(1)
    assert slots.free == 4
    await asyncio.gather(small, large, return_exceptions=True)


def test_a_reservation_is_refused_when_it_does_not_fit_and_shrinks_to_what_was_used():
    clock = FakeClock()
    limiter = RateLimiter(clock=clock)
    who = Principal("k", KeyLimits(tokens_per_minute=300))
    first = limiter.reserve(who, 250)
    with pytest.raises(RateLimited) as info:
        limiter.reserve(who, 100)
    assert info.value.headers["Retry-After"] == "60" and "50 of its 300" in info.value.message
    first.used = 120  # the request stopped early: 130 tokens come back
    limiter.settle(first)
    assert limiter.reserve(who, 100) is not None
    with pytest.raises(RateLimited, match="over API key 'k''s limit of 300"):
        limiter.reserve(who, 301)  # can never fit


def test_the_limit_is_shared_by_the_replicas():
    limiter = RateLimiter(clock=FakeClock(), replicas=lambda: 3)
    who = Principal("k", KeyLimits(tokens_per_minute=300, max_concurrent=7))
    assert limiter.shares(who.limits) == (100, 2)
    with pytest.raises(RateLimited, match="share of 3"):
        limiter.reserve(who, 101)


async def test_a_batch_over_the_limit_is_refused_before_tokenizing(dataplane):  # noqa: F811
    dataplane.settings = dataplane.settings.model_copy(update={"max_batch_prompts": 4})
    caller = RequestContext(principal=Principal("anyone", KeyLimits()))
    with pytest.raises(BadRequest, match=r"5 prompts in one request.*limit of 4") as info:
        await dataplane.completion(CompletionRequest(model="m", prompt=["a"] * 5), caller)
    assert info.value.param == "prompt"


async def test_a_key_is_charged_for_every_prompt_before_it_runs(dataplane):  # noqa: F811
    """8 prompts of 10 tokens, max_tokens 4: 8 * (10 + 4) = 112 tokens reserved up front. A key of
    100 tokens a minute is refused before any token is generated (the old charge-as-you-go let it
    run and overdraw)."""
    dataplane.limiter = RateLimiter(clock=FakeClock())
    caller = RequestContext(principal=Principal("team", KeyLimits(tokens_per_minute=100)))
    batch = CompletionRequest(model="m", prompt=[[1] * 10] * 8, max_tokens=4)
    with pytest.raises(RateLimited, match="needs up to 112 tokens"):
        await dataplane.completion(batch, caller)
    smaller = CompletionRequest(model="m", prompt=[[1] * 10] * 4, max_tokens=4)
    answer = await (await dataplane.completion(smaller, caller)).response()
    assert answer.usage.total_tokens == 56
    state = dataplane.limiter._states["team"]
    assert sum(tokens for _, tokens in state.charges) == 56
