"""The server's bounded admission queue: at most `max_running` requests in the engines, at most
`max_waiting` more waiting for a place; beyond that a request is refused at once (429), so memory
never grows without bound under overload."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from modelfleet.dataplane.server.errors import RateLimited


class AdmissionQueue:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_running)

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        if self.running >= self.max_running or self.waiting:
            if self.waiting >= self.max_waiting:
                raise RateLimited(
                    f"server is at capacity ({self.running} running, {self.waiting} waiting, "
                    f"queue limit {self.max_waiting}); retry shortly",
                    retry_after=1.0,
                    code="queue_full",
                )
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
