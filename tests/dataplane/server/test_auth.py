"""API keys, per-key limits and the bounded admission queue (no HTTP, no engine)."""

from __future__ import annotations

import asyncio
import json

import pytest
from modelfleet.dataplane.server.admission import AdmissionQueue
from modelfleet.dataplane.server.auth import (
    KeyFileError,
    KeyLimits,
    KeyStore,
    Principal,
    RateLimiter,
    hash_key,
)
from modelfleet.dataplane.server.errors import RateLimited, Unauthorized


def test_plain_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(
        f"# team keys\n{hash_key('sk-one')}\n\n{hash_key('sk-two').upper()}  # upper case is fine\n"
    )
    store = KeyStore(path)
    assert not store.open
    assert store.authenticate("Bearer sk-one").key_id == hash_key("sk-one")[:12]
    assert store.authenticate("bearer sk-two").key_id == hash_key("sk-two")[:12]
    for header, reason in [
        (None, "missing API key"),
        ("Bearer sk-three", "invalid API key"),
        ("Basic x", "malformed"),
    ]:
        with pytest.raises(Unauthorized, match=reason):
            store.authenticate(header)


def test_json_key_file_with_limits(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps(
            [{"sha256": hash_key("sk-a"), "name": "team-a", "tokens_per_minute": 100, "max_concurrent": 2}]
        )
    )
    principal = KeyStore(path).authenticate("Bearer sk-a")
    assert principal == Principal(key_id="team-a", limits=KeyLimits(tokens_per_minute=100, max_concurrent=2))
    path.write_text(json.dumps({hash_key("sk-b"): {"max_concurrent": 1}}))
    assert KeyStore(path, KeyLimits(tokens_per_minute=7)).authenticate("Bearer sk-b").limits == KeyLimits(
        7, 1
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sk-plaintext-key\n", "line 1: expected a sha256 hex digest"),
        ('[{"sha256": "abc"}]', "entry 0: 'sha256' must be a sha256 hex digest"),
        ("[{bad json", "not valid JSON at line 1"),
        (json.dumps([{"sha256": "a" * 64, "max_concurrent": "many"}]), "must be integers"),
    ],
)
def test_bad_key_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=message) as info:
        KeyStore(path)
    assert "\n" not in str(info.value)
    assert "sk-plaintext-key" not in str(info.value)


def test_no_key_file_is_open():
    store = KeyStore(None)
    assert store.open
    assert store.authenticate(None).key_id == "anonymous"


def test_key_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_text(hash_key("sk-old") + "\n")
    store = KeyStore(path)
    path.write_text(hash_key("sk-new") + "\n" + "0" * 64 + "\n")
    store.refresh()
    assert store.authenticate("Bearer sk-new")
    with pytest.raises(Unauthorized):
        store.authenticate("Bearer sk-old")
    path.write_text("garbage\n")  # a bad rewrite keeps the last good keys
    store.refresh()
    assert store.authenticate("Bearer sk-new")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_rate_limit_counts_the_last_minute():
    clock = FakeClock()
    limiter = RateLimiter(clock=clock)
    who = Principal("k", KeyLimits(tokens_per_minute=60))
    limiter.acquire(who)
    limiter.charge(who, 90)  # tokens used outside a reservation still count
    limiter.release(who)
    with pytest.raises(RateLimited) as info:
        limiter.acquire(who)
    assert info.value.status == 429
    assert info.value.headers["Retry-After"] == "60"  # when the charge leaves the 60 s window
    clock.now += 60
    limiter.acquire(who)


def test_concurrency_cap():
    limiter = RateLimiter(clock=FakeClock())
    who = Principal("k", KeyLimits(max_concurrent=2))
    limiter.acquire(who)
    limiter.acquire(who)
    with pytest.raises(RateLimited, match="2 requests in flight") as info:
        limiter.acquire(who)
    assert info.value.headers["Retry-After"] == "1"
    limiter.release(who)
    limiter.acquire(who)
    other = Principal("other", KeyLimits(max_concurrent=2))
    limiter.acquire(other)  # limits are per key


@pytest.mark.parametrize("limits", [KeyLimits(tokens_per_minute=1000), KeyLimits()], ids=["rate", "none"])
def test_a_cap_added_by_a_key_file_reload_counts_only_requests_still_in_flight(limits):
    """Requests of a key without a cap that ended leave no count behind: when a reload of the key file
    gives it a concurrency cap, they do not count against it."""
    limiter = RateLimiter(clock=FakeClock())
    before = Principal("k", limits)
    for _ in range(2):
        limiter.acquire(before)
        limiter.release(before)
    after = Principal("k", KeyLimits(tokens_per_minute=1000, max_concurrent=1))
    limiter.acquire(after)
    with pytest.raises(RateLimited, match="1 requests in flight"):
        limiter.acquire(after)


def test_a_request_made_after_a_reload_removed_the_cap_does_not_free_a_capped_requests_place():
    limiter = RateLimiter(clock=FakeClock())
    capped, uncapped = Principal("k", KeyLimits(max_concurrent=1)), Principal("k", KeyLimits())
    limiter.acquire(capped)  # still running
    limiter.acquire(uncapped)
    limiter.release(uncapped)
    with pytest.raises(RateLimited, match="1 requests in flight"):
        limiter.acquire(capped)


def test_a_full_window_says_when_enough_of_it_leaves():
    """At exactly the limit a request is refused; Retry-After is when the oldest charges have left so
    that less than the limit remains, and at least 1 s."""
    clock = FakeClock()
    limiter = RateLimiter(clock=clock)
    who = Principal("k", KeyLimits(tokens_per_minute=60))
    for tokens in (1, 10, 49):  # at +0, +5 and +10 s
        limiter.charge(who, tokens)
        clock.now += 5
    with pytest.raises(RateLimited) as info:
        limiter.acquire(who)
    # At +15 s: the first charge leaves at +60 s, and then 59 of 60 remain; the second is not needed.
    assert info.value.headers["Retry-After"] == "45"
    assert "share" not in info.value.message  # one replica: the whole limit
    clock.now += 44.5
    with pytest.raises(RateLimited) as info:
        limiter.acquire(who)
    assert info.value.headers["Retry-After"] == "1"  # half a second, rounded up
    clock.now += 0.5
    limiter.acquire(who)


def test_with_two_replicas_each_enforces_and_names_its_share():
    limiter = RateLimiter(clock=FakeClock(), replicas=lambda: 2)
    who = Principal("k", KeyLimits(tokens_per_minute=60))
    limiter.charge(who, 30)
    with pytest.raises(RateLimited, match="limit of 30 tokens per minute, this replica's share of 2"):
        limiter.acquire(who)


def test_what_a_key_did_before_it_had_a_token_rate_does_not_count_against_one():
    """Tokens of a key without a rate are not kept; a reservation that never ran keeps nothing."""
    limiter = RateLimiter(clock=FakeClock())
    limiter.charge(Principal("k", KeyLimits()), 100)
    who = Principal("k", KeyLimits(tokens_per_minute=50))
    limiter.settle(limiter.reserve(who, 50))  # refused before it ran: used stays None
    assert limiter.reserve(who, 50) is not None


async def test_admission_queue_is_bounded():
    queue = AdmissionQueue(max_running=1, max_waiting=1)
    release = asyncio.Event()
    order = []

    async def job(name: str) -> None:
        async with queue.admit():
            order.append(name)
            await release.wait()

    first = asyncio.create_task(job("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(job("second"))
    await asyncio.sleep(0)
    assert (queue.running, queue.waiting) == (1, 1)
    with pytest.raises(RateLimited, match="queue limit 1") as info:
        async with queue.admit():
            pass
    assert info.value.code == "queue_full"
    release.set()
    await asyncio.gather(first, second)
    assert order == ["first", "second"]
    assert (queue.running, queue.waiting) == (0, 0)


async def test_cancelled_waiter_leaves_the_queue():
    queue = AdmissionQueue(max_running=1, max_waiting=4)
    async with queue.admit():
        waiter = asyncio.create_task(queue.admit().__aenter__())
        await asyncio.sleep(0)
        assert queue.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert queue.waiting == 0
    async with queue.admit():
        assert queue.running == 1


async def test_admission_queue_refuses_exactly_one_past_max_waiting():
    """With 1 running and max_waiting=2, a second waiter still queues and the third is refused at once
    (checked without awaiting it, so a queue that lets one more wait fails here instead of hanging)."""
    queue = AdmissionQueue(max_running=1, max_waiting=2)
    release = asyncio.Event()

    async def job() -> None:
        async with queue.admit():
            await release.wait()

    jobs = [asyncio.create_task(job()) for _ in range(3)]
    for _ in range(3):
        await asyncio.sleep(0)
    assert (queue.running, queue.waiting) == (1, 2)
    assert not any(j.done() for j in jobs)
    extra = asyncio.create_task(job())
    for _ in range(3):
        await asyncio.sleep(0)
    try:
        assert extra.done(), "a third waiter was queued past max_waiting=2"
        assert isinstance(extra.exception(), RateLimited)
        assert "queue limit 2" in extra.exception().message
        assert extra.exception().headers["Retry-After"] == "1"
        assert (queue.running, queue.waiting) == (1, 2)
    finally:
        extra.cancel()
        release.set()
        await asyncio.gather(*jobs, return_exceptions=True)
    assert (queue.running, queue.waiting) == (0, 0)


async def test_a_gate_admits_up_to_max_running_without_waiting():
    queue = AdmissionQueue(max_running=2, max_waiting=0)  # no waiting: a request that must wait is refused
    async with queue.admit(), queue.admit():
        assert queue.running == 2
        with pytest.raises(RateLimited):
            async with queue.admit():
                pass


async def test_a_replaced_gate_still_counts_while_its_requests_run():
    from modelfleet.dataplane.server.admission import Admission

    admission = Admission(max_waiting=4)
    old = admission.gate("m", "v1", 2)
    async with old.admit():
        new = admission.gate("m", "v1", 3)  # the engine was reloaded with another size
        assert new is not old and new.max_running == 3
        assert admission.running == 1
        assert admission.gate("m", "v1", 3) is new
        assert admission.running == 1
    assert admission.running == 0


def test_a_reservation_may_fill_the_window_exactly():
    limiter = RateLimiter(clock=FakeClock())
    who = Principal("k", KeyLimits(tokens_per_minute=30))
    assert limiter.reserve(who, 20) is not None
    assert limiter.reserve(who, 10) is not None  # 30 of 30
    with pytest.raises(RateLimited):
        limiter.reserve(who, 1)


def test_releasing_more_than_was_acquired_does_not_raise_the_cap():
    limiter = RateLimiter(clock=FakeClock())
    who = Principal("k", KeyLimits(max_concurrent=1))
    limiter.release(who)  # nothing acquired yet
    limiter.acquire(who)
    limiter.release(who)
    limiter.release(who)
    limiter.acquire(who)
    with pytest.raises(RateLimited, match="1 requests in flight"):
        limiter.acquire(who)
