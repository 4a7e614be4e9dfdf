"""The replica count that divides each key's limits follows the live pods (a headless Service's
addresses) and survives a failed lookup."""

from __future__ import annotations

import asyncio

from modelfleet.dataplane.server.auth import KeyLimits, RateLimiter
from modelfleet.dataplane.server.peers import ReplicaCount, resolve_addresses


async def test_the_share_follows_the_live_replica_count():
    answers: list[set[str] | Exception] = [
        {"10.0.0.1", "10.0.0.2", "10.0.0.3"},
        OSError("no DNS"),
        set(),
        {"10.0.0.1"},
    ]

    async def resolve(name: str) -> set[str]:
        assert name == "chat-peers.team.svc"
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    replicas = ReplicaCount(2, "chat-peers.team.svc", resolve=resolve)
    limiter = RateLimiter(replicas=replicas)
    limits = KeyLimits(tokens_per_minute=900)
    assert limiter.shares(limits) == (450, 0)  # the fixed count until the first lookup
    await replicas.refresh()
    assert limiter.shares(limits) == (300, 0)
    await replicas.refresh()  # the lookup fails: the last count stays
    await replicas.refresh()  # no addresses (every pod unready): the last count stays
    assert replicas() == 3
    await replicas.refresh()  # scaled in to one
    assert limiter.shares(limits) == (900, 0)


async def test_polling_starts_and_stops():
    seen: list[str] = []

    async def resolve(name: str) -> set[str]:
        seen.append(name)
        return {"10.0.0.1", "10.0.0.2"}

    replicas = ReplicaCount(1, "peers", poll_seconds=0.01, resolve=resolve)
    replicas.start()
    await asyncio.sleep(0.05)
    await replicas.stop()
    assert replicas() == 2 and len(seen) >= 2


async def test_localhost_resolves():
    assert await resolve_addresses("localhost")
