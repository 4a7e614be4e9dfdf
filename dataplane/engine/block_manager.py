"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, and prefix caching.

Plain Python, no torch: the model runner owns the tensors, this module only decides which block ids a
sequence's tokens live in. A full block is named by a chained hash (its parent's hash and its tokens), so
two sequences with the same prefix share blocks. Freed blocks keep their hash and stay findable until
they are handed out again: free blocks are reused least recently freed first, blocks that hold no cached
prefix before those that do, and a sequence's tail blocks before its head blocks.

With a host tier (host_kv.HostBlockPool), a cached block handed out again is spilled to host memory
first, and a waiting request whose prefix continues into spilled blocks loads them back before it is
admitted (`waits_for_blocks`): device blocks are taken for them at once, held for the request together
with its device hits, and named in the prefix cache when the engine reports the copies done
(`finish_loads`). The copies themselves are the engine's (`take_copies`).
"""

from __future__ import annotations

from collections import OrderedDict

from modelfleet.dataplane.engine.host_kv import Copies, HostBlockPool
from modelfleet.dataplane.engine.sequence import Sequence


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set while the block holds a full block of tokens that the prefix cache can find.
        self.block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is 64-bit and the same in every process (no hash randomization).
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        host: HostBlockPool | None = None,
        max_loads_per_step: int = 64,
    ) -> None:
        """`max_loads_per_step`: blocks that start loading from the host tier in one step (the first
        request to load in a step starts whatever it needs)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks: {num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Front is reused first. Values unused: an ordered set with O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        # Per request: how many of its leading blocks are already registered in the prefix cache.
        self._num_registered: dict[str, int] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        # The host tier: None without one.
        self.host = host if enable_prefix_caching else None
        self.max_loads_per_step = max_loads_per_step
        self._copies = Copies()
        self._loads_left = max_loads_per_step
        # Per waiting request: device blocks held for its prefix, and of those the ones still loading as
        # (device block, host block, hash). Loads of requests that ended while loading: `_orphaned`.
        self._held: dict[str, list[int]] = {}
        self._loading: dict[str, list[tuple[int, int, int]]] = {}
        self._orphaned: dict[str, list[tuple[int, int, int]]] = {}
        self.num_host_hit_tokens = 0
        self.num_spills = 0
        self.num_dropped_spills = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they will be handed out."""
        return list(self._free)

    def cached_block_id(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest cached prefix of `seq` as (block ids, number of tokens); nothing is taken yet."""
        if not self.enable_prefix_caching:
            return [], 0
        # The last token is always computed so that the step yields logits for it.
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        self._hash_full_blocks(seq, max_hit_blocks)
        hit_ids: list[int] = []
        for block_hash in seq.block_hashes[:max_hit_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hit_ids.append(block_id)
        self.num_query_tokens += seq.num_tokens
        self.num_hit_tokens += len(hit_ids) * self.block_size
        return hit_ids, len(hit_ids) * self.block_size

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_block_ids: list[int] | tuple[()] = ()
    ) -> bool:
        """Gives `seq` blocks for `num_new_tokens` more tokens after its computed ones (and after the
        prefix-cache hits `computed_block_ids`, which it then shares). False, changing nothing, if the
        free blocks do not suffice."""
        num_computed = seq.num_computed_tokens + len(computed_block_ids) * self.block_size
        if not computed_block_ids:
            # Fast path of most decode steps: the tokens fit the blocks held and fill none newly.
            total = num_computed + num_new_tokens
            if total <= len(seq.block_ids) * self.block_size and (
                not self.enable_prefix_caching
                or total // self.block_size <= self._num_registered.get(seq.request_id, 0)
            ):
                return True
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(seq.block_ids) - len(computed_block_ids)
        # A hit on a free block takes it out of the free pool too.
        num_free_hits = sum(1 for b in computed_block_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_free_hits > len(self._free):
            return False
        for block_id in computed_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        if self._held:
            # The request holds its hits itself now.
            for block_id in self._held.pop(seq.request_id, ()):
                self._release(block_id)
        seq.block_ids.extend(computed_block_ids)
        if computed_block_ids:
            self._num_registered[seq.request_id] = len(seq.block_ids)
        for _ in range(max(num_new_blocks, 0)):
            seq.block_ids.append(self._take_free_block())
        if self.enable_prefix_caching:
            # A block whose last token is still in flight (not yet on the host) is named a step later.
            num_full = min(num_computed + num_new_tokens, seq.num_tokens) // self.block_size
            self._register_full_blocks(seq, num_full)
        return True

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks; blocks no one else holds become free (and stay cached)."""
        for block_id in reversed(seq.block_ids):
            self._release(block_id)
        seq.block_ids = []
        self._num_registered.pop(seq.request_id, None)
        if self._held:
            self._drop_hold(seq.request_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                # Holds nothing reusable: hand it out before blocks that do.
                self._free.move_to_end(block_id, last=False)

    def _drop_hold(self, request_id: str) -> None:
        """A request that ended (or was preempted) while it held blocks: blocks still being copied into
        stay taken until their copies are done."""
        loading = self._loading.pop(request_id, [])
        if loading:
            self._orphaned[request_id] = loading
        busy = {device_id for device_id, _, _ in loading}
        for block_id in self._held.pop(request_id, ()):
            if block_id not in busy:
                self._release(block_id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Rolls back slots past `num_tokens` (a speculative step's rejected drafts): the blocks beyond
        them are freed. They hold no named prefix (only tokens on the host are named), so they are
        handed out first again."""
        num_kept = -(-num_tokens // self.block_size)
        for block_id in seq.block_ids[num_kept:]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        del seq.block_ids[num_kept:]

    def reset_prefix_cache(self) -> None:
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
        self._cached.clear()
        if self.host is not None:
            self.host.clear()

    def waits_for_blocks(self, seq: Sequence) -> bool:
        """Whether the waiting `seq` must wait for blocks loading from the host tier. Starts the loads
        when its prefix continues into host blocks, the step's load budget allows and the free blocks
        hold the whole prompt; otherwise (False) it is admitted with its device hits alone."""
        if self.host is None:
            return False
        request_id = seq.request_id
        if request_id in self._loading or request_id in self._orphaned:
            return True
        if request_id in self._held:
            return False  # loaded: its blocks are prefix-cache hits now
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        self._hash_full_blocks(seq, max_hit_blocks)
        device_hits: list[int] = []
        host_hits: list[tuple[int, int]] = []  # (host block, hash)
        for block_hash in seq.block_hashes[:max_hit_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is not None:
                device_hits.append(block_id)
                continue
            host_id = self.host.lookup(block_hash)
            if host_id is None:
                break
            host_hits.append((host_id, block_hash))
        if not host_hits:
            return False
        if len(host_hits) > self._loads_left and self._loads_left < self.max_loads_per_step:
            return True  # the step's copies are spent: next step
        num_free_hits = sum(1 for b in device_hits if self.blocks[b].ref_count == 0)
        num_prompt_blocks = -(-seq.num_tokens // self.block_size)
        if num_free_hits + num_prompt_blocks - len(device_hits) > len(self._free):
            return False
        self._loads_left -= len(host_hits)
        for block_id in device_hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        for host_id, _ in host_hits:
            self.host.pin(host_id)  # before taking device blocks, whose spills must not reuse it
        loading = [(self._take_free_block(), host_id, h) for host_id, h in host_hits]
        self._held[request_id] = device_hits + [device_id for device_id, _, _ in loading]
        self._loading[request_id] = loading
        self._copies.loads[request_id] = [(device_id, host_id) for device_id, host_id, _ in loading]
        self.num_host_hit_tokens += len(host_hits) * self.block_size
        return True

    def finish_loads(self, request_ids: list[str]) -> None:
        """The engine's word that these requests' loads have landed: their blocks join the prefix cache."""
        host = self.host
        assert host is not None
        for request_id in request_ids:
            orphaned = self._orphaned.pop(request_id, None)
            loads = orphaned if orphaned is not None else self._loading.pop(request_id, [])
            for device_id, host_id, block_hash in loads:
                host.unpin(host_id)
                block = self.blocks[device_id]
                if block.block_hash is None and block_hash not in self._cached:
                    block.block_hash = block_hash
                    self._cached[block_hash] = device_id
                if orphaned is not None:
                    self._release(device_id)

    def take_copies(self) -> Copies:
        """The spills and loads decided since the last call (once per step), for the engine to issue
        before the step that may overwrite the spilled blocks; the step's load budget starts again."""
        copies, self._copies = self._copies, Copies()
        self._loads_left = self.max_loads_per_step
        return copies

    def _spill(self, block_id: int, block_hash: int) -> None:
        host = self.host
        assert host is not None
        host_id = host.lookup(block_hash)
        if host_id is not None:  # still there from an earlier spill: the same tokens
            host.touch(block_hash)
            return
        host_id = host.store(block_hash)
        if host_id is None:
            self.num_dropped_spills += 1
            return
        self._copies.spills.append((block_id, host_id))
        self.num_spills += 1

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                if self.host is not None:
                    self._spill(block_id, block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _hash_full_blocks(self, seq: Sequence, num_blocks: int) -> None:
        size = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(seq.token_ids[i * size : (i + 1) * size])))

    def _register_full_blocks(self, seq: Sequence, num_full_blocks: int) -> None:
        start = self._num_registered.get(seq.request_id, 0)
        if num_full_blocks <= start:
            return
        self._hash_full_blocks(seq, num_full_blocks)
        for i in range(start, num_full_blocks):
            block = self.blocks[seq.block_ids[i]]
            block_hash = seq.block_hashes[i]
            # Another sequence may have computed the same block first: keep its copy as the cached one.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
        self._num_registered[seq.request_id] = num_full_blocks
