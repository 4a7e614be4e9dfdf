"""Block manager: exact block ids for allocation, prefix hits, reference counts and reuse order."""

import pytest
from modelfleet.dataplane.engine.block_manager import BlockManager, hash_block
from modelfleet.dataplane.engine.sequence import Sequence
from modelfleet.dataplane.sampling_params import SamplingParams

BLOCK = 4


def make_seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams())


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admits a sequence the way the scheduler does: prefix hits, then slots for the rest of its prompt."""
    hits, num_hit = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - num_hit, hits)
    seq.num_computed_tokens = seq.num_tokens
    return num_hit


def test_allocate_fresh_prompt_takes_blocks_in_order_and_caches_full_ones():
    bm = BlockManager(10, BLOCK)
    seq = make_seq("a", list(range(10)))
    assert admit(bm, seq) == 0
    assert seq.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 7
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    h0 = hash_block(None, (0, 1, 2, 3))
    h1 = hash_block(h0, (4, 5, 6, 7))
    assert seq.block_hashes == [h0, h1]
    assert bm.cached_block_id(h0) == 0 and bm.cached_block_id(h1) == 1
    # The partial third block is not cached.
    assert bm.blocks[2].block_hash is None


def test_shared_prefix_shares_blocks_and_counts_references():
    bm = BlockManager(10, BLOCK)
    a = make_seq("a", list(range(10)))
    b = make_seq("b", [*range(8), 99, 98, 97])
    admit(bm, a)
    assert admit(bm, b) == 8
    assert b.block_ids == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 6
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 21)


def test_prefix_must_differ_from_the_start_to_miss():
    bm = BlockManager(10, BLOCK)
    admit(bm, make_seq("a", list(range(8))))
    # Same second block, different first block: the chain hash differs, so nothing is shared.
    b = make_seq("b", [9, 9, 9, 9, 4, 5, 6, 7, 1])
    assert admit(bm, b) == 0
    assert b.block_ids == [2, 3, 4]


def test_fully_cached_prompt_still_computes_its_last_block():
    bm = BlockManager(10, BLOCK)
    admit(bm, make_seq("a", list(range(8))))
    b = make_seq("b", list(range(8)))
    hits, num_hit = bm.get_computed_blocks(b)
    assert (hits, num_hit) == ([0], 4)
    assert bm.allocate_slots(b, 4, hits)
    assert b.block_ids == [0, 2]


def test_free_orders_blocks_uncached_first_then_tail_before_head():
    bm = BlockManager(6, BLOCK)
    a = make_seq("a", list(range(10)))
    admit(bm, a)
    assert bm.free_block_ids() == [3, 4, 5]
    bm.free(a)
    assert a.block_ids == []
    # Block 2 holds a partial block (nothing to reuse) so it goes first; cached 1 before cached 0.
    assert bm.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert bm.num_free_blocks == 6


def test_hit_on_freed_cached_blocks_takes_them_back_from_the_free_pool():
    bm = BlockManager(6, BLOCK)
    a = make_seq("a", list(range(10)))
    admit(bm, a)
    bm.free(a)
    b = make_seq("b", [*range(8), 50])
    assert admit(bm, b) == 8
    assert b.block_ids == [0, 1, 2]
    assert bm.free_block_ids() == [3, 4, 5]


def test_reusing_a_cached_free_block_evicts_it_from_the_prefix_cache():
    bm = BlockManager(4, BLOCK)
    a = make_seq("a", list(range(8)))
    admit(bm, a)
    bm.free(a)
    h0 = a.block_hashes[0]
    assert bm.free_block_ids() == [2, 3, 1, 0]
    b = make_seq("b", [7] * 16)
    admit(bm, b)
    assert b.block_ids == [2, 3, 1, 0]
    assert bm.cached_block_id(h0) is None
    c = make_seq("c", list(range(9)))
    hits, num_hit = bm.get_computed_blocks(c)
    assert (hits, num_hit) == ([], 0)


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(3, BLOCK)
    a = make_seq("a", list(range(8)))
    admit(bm, a)
    b = make_seq("b", list(range(100, 109)))
    assert not bm.allocate_slots(b, 9)
    assert b.block_ids == []
    assert bm.free_block_ids() == [2]
    # A free cached block that is hit counts against the free pool as well.
    bm.free(a)
    c = make_seq("c", [*range(8), 1, 2, 3, 4, 5])
    hits, _ = bm.get_computed_blocks(c)
    assert hits == [0, 1]
    assert not bm.allocate_slots(c, 5, hits)
    assert bm.free_block_ids() == [2, 1, 0]
    assert [b.ref_count for b in bm.blocks] == [0, 0, 0]


def test_decode_appends_a_block_when_the_last_one_fills_and_caches_it():
    bm = BlockManager(4, BLOCK)
    a = make_seq("a", [1, 2, 3])
    admit(bm, a)
    assert a.block_ids == [0]
    a.append_token(4)
    assert bm.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert a.block_ids == [0]
    assert bm.cached_block_id(hash_block(None, (1, 2, 3, 4))) == 0
    a.append_token(5)
    assert bm.allocate_slots(a, 1)
    assert a.block_ids == [0, 1]


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(10, BLOCK, enable_prefix_caching=False)
    admit(bm, make_seq("a", list(range(10))))
    b = make_seq("b", list(range(10)))
    assert admit(bm, b) == 0
    assert b.block_ids == [3, 4, 5]
    assert bm.blocks[0].block_hash is None
