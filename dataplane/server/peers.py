"""How many replicas share each API key's limits, so that each enforces its share of them.

Either a fixed number (`MODELFLEET_REPLICAS`), or the live count: the addresses of a headless Service
over the model's ready pods (`MODELFLEET_PEERS_DNS`, e.g. `chat-peers.team-a.svc.cluster.local`),
resolved every `MODELFLEET_PEERS_POLL_SECONDS`. The live count follows the autoscaler; a lookup that
fails or finds nothing keeps the last count (at start, the fixed number), and is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger("modelfleet.server")

Resolver = Callable[[str], Awaitable[set[str]]]


async def resolve_addresses(name: str) -> set[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


class ReplicaCount:
    def __init__(
        self,
        fixed: int,
        dns_name: str | None = None,
        *,
        poll_seconds: float = 10.0,
        resolve: Resolver = resolve_addresses,
    ) -> None:
        self.count = max(1, fixed)
        self.dns_name = dns_name
        self.poll_seconds = poll_seconds
        self.resolve = resolve
        self._task: asyncio.Task | None = None

    def __call__(self) -> int:
        return self.count

    async def refresh(self) -> None:
        try:
            addresses = await self.resolve(self.dns_name)  # type: ignore[arg-type]
        except (OSError, UnicodeError) as exc:
            log.warning(
                "peers: cannot resolve %s (%s); limits stay shared by %d", self.dns_name, exc, self.count
            )
            return
        if not addresses:
            log.warning("peers: %s has no addresses; limits stay shared by %d", self.dns_name, self.count)
            return
        if len(addresses) != self.count:
            log.info("peers: %d replicas share the API keys' limits", len(addresses))
        self.count = len(addresses)

    def start(self) -> None:
        if self.dns_name and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.poll_seconds)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
