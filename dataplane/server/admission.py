"""The server's bounded admission: one gate per loaded version, sized by what its engine runs at once.

A version admits as many requests as its engine's `max_num_seqs` (lowered by MODELFLEET_MAX_RUNNING when
that is set), so requests wait here, where they are counted, rather than in the engine's own queue. At
most `max_waiting` requests wait in the whole server; beyond that a request is refused at once (429), so
memory never grows without bound under overload.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from modelfleet.dataplane.server.errors import RateLimited
from modelfleet.dataplane.server.slots import Slots


class WaitingRoom:
    """The bound on waiting requests that several gates share."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting = 0


class AdmissionQueue:
    """At most `max_running` sequences inside, the others waiting in arrival order. A request takes a
    place per sequence it runs (its prompts times `n`), all of them at most."""

    def __init__(self, max_running: int, max_waiting: int, *, room: WaitingRoom | None = None) -> None:
        if max_running < 1:
            raise ValueError(f"max_running: {max_running} must be at least 1")
        self.max_running = max_running
        self.room = room or WaitingRoom(max_waiting)
        self.running = 0
        self.waiting = 0
        self._slots = Slots(max_running)

    @property
    def max_waiting(self) -> int:
        return self.room.max_waiting

    @asynccontextmanager
    async def admit(self, sequences: int = 1) -> AsyncIterator[None]:
        weight = max(1, min(sequences, self.max_running))
        if self.running + weight > self.max_running or self.waiting:
            if self.room.waiting >= self.room.max_waiting:
                raise RateLimited(
                    f"server is at capacity ({self.running} running, {self.room.waiting} waiting, "
                    f"queue limit {self.room.max_waiting}); retry shortly",
                    retry_after=1.0,
                    code="queue_full",
                )
            self.waiting += 1
            self.room.waiting += 1
            try:
                await self._slots.acquire(weight)
            finally:
                self.waiting -= 1
                self.room.waiting -= 1
        else:
            await self._slots.acquire(weight)
        self.running += weight
        try:
            yield
        finally:
            self.running -= weight
            self._slots.release(weight)


class Admission:
    """The gates of every version, keyed by (model, version), sharing one waiting room."""

    def __init__(self, max_waiting: int, *, cap: int = 0) -> None:
        self.room = WaitingRoom(max_waiting)
        self.cap = cap  # MODELFLEET_MAX_RUNNING; 0: no cap below the engine's own
        self.gates: dict[tuple[str, str], AdmissionQueue] = {}
        self._draining: list[tuple[tuple[str, str], AdmissionQueue]] = []  # replaced, still in use

    def limit(self, engine_max_num_seqs: int) -> int:
        return min(self.cap, engine_max_num_seqs) if self.cap else engine_max_num_seqs

    def gate(self, model: str, version: str, engine_max_num_seqs: int) -> AdmissionQueue:
        """The version's gate, sized for its engine; a reloaded engine of another size gets a new one."""
        key, limit = (model, version), self.limit(engine_max_num_seqs)
        gate = self.gates.get(key)
        if gate is None or gate.max_running != limit:
            if gate is not None:
                self._draining.append((key, gate))
            gate = self.gates[key] = AdmissionQueue(limit, self.room.max_waiting, room=self.room)
        self._draining = [(k, g) for k, g in self._draining if g.running or g.waiting]
        return gate

    def _all(self) -> list[tuple[tuple[str, str], AdmissionQueue]]:
        return [*self.gates.items(), *self._draining]

    @property
    def waiting(self) -> int:
        return self.room.waiting

    @property
    def running(self) -> int:
        return sum(gate.running for _, gate in self._all())

    def waiting_by_version(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for key, gate in self._all():
            counts[key] = counts.get(key, 0) + gate.waiting
        return counts
