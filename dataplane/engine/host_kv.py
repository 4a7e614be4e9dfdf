"""A host-memory tier under the device's prefix cache.

When the block manager hands out a free device block that still holds a cached prefix block, the block
is first copied to host memory (a spill), where it stays findable by its hash. A later request whose
prefix continues into spilled blocks gets device blocks for them and waits, out of the batch, while they
are copied back (a load); then they are ordinary prefix-cache hits.

`HostBlockPool` is the host side's bookkeeping (plain Python): a bounded pool of host block ids, named by
block hash, reused least recently used first; a block that a load still reads is pinned and never reused.
`KVSwapper` does the copies (torch): spills on the compute stream, so that they run before any later step
overwrites the device block; loads on a stream of their own, each request's batch followed by an event
that the engine polls, so that the batch never waits for them. On the CPU both are plain copies.

Ordering on CUDA: a spill is queued on the compute stream after every step launched so far and before
the step of its own schedule, so it reads the block's last keys and values before anyone overwrites
them. The load stream first waits for the compute stream (the spills just queued, which may fill the
host blocks it reads, and the launched steps, which may still touch the device blocks it writes). A
loading request holds its device blocks and pins its host blocks until the engine is told the load is
done, which happens only once its event has completed (the compute stream waits on it then); only after
that do the blocks enter the prefix cache and so any block table, CUDA-graph replays included.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from modelfleet.dataplane.engine.block_manager import BlockManager


class HostBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: {num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self._unused = list(range(num_blocks - 1, -1, -1))
        # block hash -> host block id; the front is the least recently used.
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._hash_of: dict[int, int] = {}
        self._pins: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, block_hash: int) -> int | None:
        return self._lru.get(block_hash)

    def touch(self, block_hash: int) -> None:
        self._lru.move_to_end(block_hash)

    def store(self, block_hash: int) -> int | None:
        """A host block for `block_hash` (the most recently used now), the least recently used unpinned
        block's if the pool is full; None if every block is pinned (the spill is dropped)."""
        if self._unused:
            host_id = self._unused.pop()
        else:
            victim = next((h for h, b in self._lru.items() if b not in self._pins), None)
            if victim is None:
                return None
            host_id = self._lru.pop(victim)
        self._lru[block_hash] = host_id
        self._hash_of[host_id] = block_hash
        return host_id

    def pin(self, host_id: int) -> None:
        self._pins[host_id] = self._pins.get(host_id, 0) + 1
        self.touch(self._hash_of[host_id])

    def unpin(self, host_id: int) -> None:
        count = self._pins[host_id] - 1
        if count:
            self._pins[host_id] = count
        else:
            del self._pins[host_id]

    def clear(self) -> None:
        """Forgets every block; pinned ones stay taken until unpinned (a load may still read them)."""
        for block_hash, host_id in list(self._lru.items()):
            if host_id not in self._pins:
                del self._lru[block_hash]
                self._unused.append(host_id)


@dataclass
class Copies:
    """What one schedule decided to copy: (device block, host block) pairs."""

    spills: list[tuple[int, int]] = field(default_factory=list)
    # Per request, the blocks it waits for.
    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.spills or self.loads)


class KVSwapper:
    """Copies blocks between the device's KV cache, (num_layers, 2, num_blocks, block_size, heads,
    head_dim), and a host pool of `num_host_blocks` blocks (pinned memory when the cache is on CUDA)."""

    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int) -> None:
        import torch

        self.kv_cache = kv_cache
        num_layers, _, _, *block_shape = kv_cache.shape
        cuda = kv_cache.device.type == "cuda"
        # (num_host_blocks, num_layers, 2, block_size, heads, head_dim)
        self.host = torch.empty(
            (num_host_blocks, num_layers, 2, *block_shape), dtype=kv_cache.dtype, pin_memory=cuda
        )
        self.stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        # (request ids, event) per batch of loads, oldest first.
        self._in_flight: list[tuple[list[str], Any]] = []

    def issue(self, copies: Copies) -> list[str]:
        """Queues the copies; returns the requests whose loads are already done (all of them off CUDA)."""
        import torch

        cache = self.kv_cache
        for device_id, host_id in copies.spills:
            self.host[host_id].copy_(cache[:, :, device_id], non_blocking=True)
        if not copies.loads:
            return []
        if self.stream is None:
            for pairs in copies.loads.values():
                for device_id, host_id in pairs:
                    cache[:, :, device_id].copy_(self.host[host_id])
            return list(copies.loads)
        # After what the compute stream has queued: the spills above, and steps still writing to
        # device blocks freed since.
        self.stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self.stream):
            for pairs in copies.loads.values():
                for device_id, host_id in pairs:
                    cache[:, :, device_id].copy_(self.host[host_id], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._in_flight.append((list(copies.loads), event))
        return []

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def poll(self) -> list[str]:
        """Requests whose loads have landed since the last poll. The compute stream is made to wait for
        them, which costs nothing once they are done."""
        import torch

        done: list[str] = []
        while self._in_flight and self._in_flight[0][1].query():
            request_ids, event = self._in_flight.pop(0)
            if self.stream is not None:
                torch.cuda.current_stream(self.kv_cache.device).wait_event(event)
            done += request_ids
        return done


class HostTier:
    """The engine's side of the tier: the pool, the copies, and the block manager's word on them."""

    def __init__(self, runner: Any, num_bytes: int) -> None:
        kv_cache = getattr(runner, "kv_cache", None)
        if kv_cache is None or getattr(runner, "workers", None) is not None:
            raise ValueError(
                "host_kv_cache_bytes: the host KV tier needs a single-rank engine that holds its own KV "
                "cache (not tensor parallelism or an exported graph); set it to 0"
            )
        num_host_blocks = num_bytes // runner.block_bytes
        if num_host_blocks < 1:
            raise ValueError(
                f"host_kv_cache_bytes: {num_bytes} bytes hold no KV block of {runner.block_bytes} bytes; "
                "raise it or set 0 (off)"
            )
        self.pool = HostBlockPool(num_host_blocks)
        self.swapper = KVSwapper(kv_cache, num_host_blocks)

    def poll(self, block_manager: BlockManager) -> None:
        """Before a schedule: requests whose loads have landed may be admitted."""
        if self.swapper.busy:
            block_manager.finish_loads(self.swapper.poll())

    def issue(self, block_manager: BlockManager) -> None:
        """After a schedule, before its step is launched: the copies it decided."""
        copies = block_manager.take_copies()
        if copies:
            done = self.swapper.issue(copies)
            if done:
                block_manager.finish_loads(done)
