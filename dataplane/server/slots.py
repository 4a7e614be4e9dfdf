"""A semaphore whose holders take several places at once, granted strictly in arrival order: a request
for many places is never overtaken for good by a stream of small ones, and two large ones never each
hold part of what both need."""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"total: {total} must be at least 1")
        self.total = total
        self.free = total
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, weight: int) -> None:
        if not 1 <= weight <= self.total:
            raise ValueError(f"weight: {weight} must be between 1 and {self.total}")
        if not self._waiters and self.free >= weight:
            self.free -= weight
            return
        entry = (weight, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # granted as it was cancelled: give it back
                self.release(weight)
            else:
                self._waiters.remove(entry)
                self._wake()  # those behind it may fit now
            raise

    def release(self, weight: int) -> None:
        self.free += weight
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            weight, future = self._waiters.popleft()
            self.free -= weight
            future.set_result(None)
