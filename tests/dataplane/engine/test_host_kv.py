"""The host KV tier's bookkeeping: the host pool's LRU, spills of evicted prefix blocks, loads back, and a
scheduler that lets a loading request wait without holding up the batch. Plain Python, exact block ids.
Then bench/kv_tier.py's comparisons in small (CPU, and CUDA where there is one): the tier against device
prefix hits, and its check of every copy, which a misplaced load fails. Last, the ordering the CUDA
streams rely on, as the engine's bookkeeping keeps it under shared-prefix traffic."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from modelfleet.dataplane.engine.block_manager import BlockManager
from modelfleet.dataplane.engine.host_kv import HostBlockPool, KVSwapper
from modelfleet.dataplane.engine.scheduler import Scheduler
from modelfleet.dataplane.engine.sequence import Sequence

from tests.dataplane.engine.test_block_manager import BLOCK, admit, make_seq

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_host_pool_reuses_the_least_recently_used_unpinned_block():
    pool = HostBlockPool(2)
    assert pool.store(10) == 0 and pool.store(11) == 1
    pool.touch(10)  # 11 is now the least recently used
    assert pool.store(12) == 1
    assert pool.lookup(11) is None and pool.lookup(10) == 0 and len(pool) == 2
    pool.pin(pool.lookup(12))  # pinning uses it too: 10 goes next
    assert pool.store(13) == 0 and pool.lookup(10) is None
    # 12 is the least recently used but pinned: 13 goes, though it was stored last.
    assert pool.store(14) == 0
    assert pool.lookup(13) is None and pool.lookup(12) == 1 and pool.lookup(14) == 0


def test_host_pool_never_reuses_a_pinned_block():
    pool = HostBlockPool(2)
    a, b = pool.store(1), pool.store(2)
    pool.pin(a)
    pool.pin(b)
    assert pool.store(3) is None
    assert pool.lookup(1) == a and pool.lookup(2) == b
    pool.unpin(a)
    assert pool.store(3) == a and pool.lookup(1) is None
    pool.clear()  # a pinned block stays until unpinned
    assert pool.lookup(2) == b and pool.lookup(3) is None


def evict_prefix(bm: BlockManager, prompt: list[int]) -> Sequence:
    """Admits and frees `prompt`, then fills every block with other tokens so its cached blocks leave."""
    first = make_seq("first", prompt)
    admit(bm, first)
    bm.free(first)
    filler = make_seq("filler", [1000 + i for i in range(bm.num_blocks * BLOCK)])
    admit(bm, filler)
    bm.free(filler)
    return first


def test_evicted_prefix_blocks_spill_and_load_back_as_prefix_hits():
    bm = BlockManager(4, BLOCK, host=HostBlockPool(8))
    prompt = list(range(10))  # two full blocks and two tokens
    first = evict_prefix(bm, prompt)
    copies = bm.take_copies()
    # The filler took the free blocks in order: the partial block 2, then 3, then cached 1 and 0.
    assert copies.spills == [(1, 0), (0, 1)] and not copies.loads
    assert bm.num_spills == 2 and bm.cached_block_id(first.block_hashes[0]) is None

    again = make_seq("again", prompt)
    assert bm.waits_for_blocks(again)
    copies = bm.take_copies()
    # Device blocks for both, loaded from the host blocks that hold them (the filler's cached blocks
    # spill to make room).
    assert [host for _, host in copies.loads["again"]] == [1, 0]
    assert bm.num_host_hit_tokens == 8
    assert bm.waits_for_blocks(again)  # still loading
    assert bm.take_copies().loads == {}  # and not loaded twice
    loaded = [device for device, _ in copies.loads["again"]]
    bm.finish_loads(["again"])
    assert not bm.waits_for_blocks(again)
    hits, num_hit = bm.get_computed_blocks(again)
    assert hits == loaded and num_hit == 8
    assert bm.allocate_slots(again, 2, hits)
    # The request holds its blocks once, not twice.
    assert [bm.blocks[b].ref_count for b in hits] == [1, 1]
    bm.free(again)
    assert bm.num_free_blocks == 4


def test_a_spilled_block_that_the_host_still_holds_is_not_copied_again():
    bm = BlockManager(4, BLOCK, host=HostBlockPool(8))
    prompt = list(range(10))
    evict_prefix(bm, prompt)
    bm.take_copies()
    again = make_seq("again", prompt)
    assert bm.waits_for_blocks(again)
    bm.take_copies()
    bm.finish_loads(["again"])
    admit(bm, again)
    bm.free(again)
    spills = bm.num_spills
    evict_prefix(bm, [500 + i for i in range(10)])
    # The prompt's blocks left the device again, but their host copies are still there.
    assert not any(host in (0, 1) for _, host in bm.take_copies().spills)
    assert bm.num_spills > spills


def test_request_ending_while_loading_keeps_its_blocks_until_the_copies_land():
    bm = BlockManager(4, BLOCK, host=HostBlockPool(8))
    prompt = list(range(10))
    evict_prefix(bm, prompt)
    bm.take_copies()
    again = make_seq("again", prompt)
    assert bm.waits_for_blocks(again)
    loading = [device for device, _ in bm.take_copies().loads["again"]]
    bm.free(again)  # aborted while its copies are in flight
    assert not set(loading) & set(bm.free_block_ids())
    bm.finish_loads(["again"])
    assert set(loading) <= set(bm.free_block_ids())
    # The copied blocks are valid: a later request finds them on the device.
    later = make_seq("later", prompt)
    assert not bm.waits_for_blocks(later)
    assert bm.get_computed_blocks(later) == (loading, 8)


def test_full_host_pool_drops_spills_and_loses_nothing_else():
    pool = HostBlockPool(1)
    bm = BlockManager(4, BLOCK, host=pool)
    prompt = list(range(10))
    evict_prefix(bm, prompt)
    # The head block spilled last and took over the only host block.
    assert len(pool) == 1 and bm.num_spills == 2
    bm.take_copies()
    again = make_seq("again", prompt)
    assert bm.waits_for_blocks(again)
    (loading,) = bm.take_copies().loads["again"]
    # While it loads, the host block is pinned: spills find no room and are dropped.
    other = make_seq("other", [700 + i for i in range(8)])
    admit(bm, other)
    bm.free(other)
    filler = make_seq("filler", [900 + i for i in range(12)])
    admit(bm, filler)
    bm.free(filler)
    # Every cached block evicted since: the first filler's four, then other's two.
    assert bm.num_dropped_spills == 6 and bm.num_spills == 2 and bm.take_copies().spills == []
    bm.finish_loads(["again"])
    # The head block is a hit; the second block, lost from both tiers, is computed again.
    hits, num_hit = bm.get_computed_blocks(again)
    assert hits == [loading[0]] and num_hit == 4
    assert bm.allocate_slots(again, 6, hits)
    bm.free(again)
    assert bm.num_free_blocks == 4


def two_prefixes_on_the_host(max_loads_per_step: int) -> tuple[BlockManager, Sequence, Sequence]:
    """Two prompts of two full blocks each, spilled to the host by a filler; a and b ask for them."""
    bm = BlockManager(8, BLOCK, host=HostBlockPool(16), max_loads_per_step=max_loads_per_step)
    prompts = [[i * 100 + j for j in range(9)] for i in range(2)]
    for prompt in prompts:
        seq = make_seq("p", prompt)
        admit(bm, seq)
        bm.free(seq)
    filler = make_seq("filler", [5000 + i for i in range(8 * BLOCK)])
    admit(bm, filler)
    bm.free(filler)
    bm.take_copies()
    a, b = make_seq("a", prompts[0]), make_seq("b", prompts[1])
    assert bm.waits_for_blocks(a) and bm.waits_for_blocks(b)
    return bm, a, b


def test_loads_per_step_are_budgeted():
    bm, _, b = two_prefixes_on_the_host(max_loads_per_step=2)
    # a's two blocks spend the step's budget: b has not started.
    assert list(bm.take_copies().loads) == ["a"]
    assert bm.waits_for_blocks(b)
    assert list(bm.take_copies().loads) == ["b"]


def test_a_load_that_fits_what_is_left_of_the_steps_budget_starts_in_that_step():
    bm, _, _ = two_prefixes_on_the_host(max_loads_per_step=4)
    # a's two blocks leave exactly b's two of the four.
    assert list(bm.take_copies().loads) == ["a", "b"]


def test_a_load_counts_the_free_device_hits_it_takes_as_room_it_needs():
    """A prompt of three blocks, its first a device hit in the free list, its second on the host: with
    two free blocks (the hit one of them) the load cannot start; it does once a request frees blocks."""
    bm = BlockManager(5, BLOCK, host=HostBlockPool(8))
    prompt = list(range(9))
    first = make_seq("first", prompt)
    admit(bm, first)
    bm.free(first)
    running = make_seq("running", [500 + i for i in range(3 * BLOCK)])
    admit(bm, running)
    done = make_seq("done", [600 + i for i in range(BLOCK)])
    admit(bm, done)  # evicts the prompt's second block to the host
    bm.free(done)
    assert bm.cached_block_id(first.block_hashes[0]) is not None
    assert bm.cached_block_id(first.block_hashes[1]) is None and bm.num_free_blocks == 2
    bm.take_copies()
    again = make_seq("again", prompt)
    assert not bm.waits_for_blocks(again)
    assert bm.take_copies().loads == {}
    bm.free(running)
    assert bm.waits_for_blocks(again)
    assert list(bm.take_copies().loads) == ["again"]


def test_two_loads_of_one_prefix_leave_the_first_to_land_in_the_prefix_cache():
    bm = BlockManager(8, BLOCK, host=HostBlockPool(16))
    prompt = list(range(9))
    evict_prefix(bm, prompt)
    bm.take_copies()
    x, y = make_seq("x", prompt), make_seq("y", prompt)
    assert bm.waits_for_blocks(x) and bm.waits_for_blocks(y)  # both load: neither copy has landed
    loads = bm.take_copies().loads
    bm.finish_loads(["x", "y"])
    later = make_seq("later", prompt)
    assert bm.get_computed_blocks(later) == ([device for device, _ in loads["x"]], 8)


def test_scheduler_runs_others_while_a_request_waits_for_its_copies():
    bm = BlockManager(8, BLOCK, host=HostBlockPool(16))
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    prompt = list(range(9))
    evict = make_seq("evicted", prompt)
    admit(bm, evict)
    bm.free(evict)
    filler = make_seq("filler", [5000 + i for i in range(8 * BLOCK)])
    admit(bm, filler)
    bm.free(filler)
    bm.take_copies()

    scheduler.add(make_seq("hit", prompt))
    scheduler.add(make_seq("other", [7, 7, 7]))
    out = scheduler.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["other"]
    assert [s.request_id for s in scheduler.waiting] == ["hit"]
    assert list(bm.take_copies().loads) == ["hit"]
    assert [s.seq.request_id for s in scheduler.schedule().scheduled] == ["other"]  # hit still copying
    bm.finish_loads(["hit"])
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        ("other", 4, 1),
        ("hit", 8, 1),
    ]


# Blocks of 16 tokens: a KV cache of 2 x 6 blocks, 6 prefixes of 4 blocks (twice the cache), a host pool
# of 36 blocks, 24 requests of one prefix and 8 fresh tokens each.
BENCH_ARGS = [
    *("--dtype", "float32", "--concurrency", "2", "--max-model-len", "96"),
    *("--prefix-len", "64", "--suffix-len", "8", "--output-len", "4", "--num-requests", "24"),
    "--check-copies",
]


def run_bench(model_dir, monkeypatch, capsys, device: str = "cpu") -> dict[str, dict]:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[3] / "bench"))
    import kv_tier

    assert kv_tier.main(["--model", str(model_dir), "--device", device, *BENCH_ARGS]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return {line["case"]: line for line in lines}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda_only])])
def test_bench_compares_the_tier_with_device_hits_and_checks_every_copy(device, request, monkeypatch, capsys):
    """On CUDA: pinned host blocks, the load stream and its events, CUDA graphs for decodes."""
    model_dir = request.getfixturevalue("tiny_llama_dir" if device == "cuda" else "tiny_model_dir")
    cases = run_bench(model_dir, monkeypatch, capsys, device)
    assert list(cases) == ["tier_off", "gpu_hits", "tier_on"]
    off, gpu, on = cases["tier_off"], cases["gpu_hits"], cases["tier_on"]
    assert off["kv_cache_blocks"] == on["kv_cache_blocks"] == 12 and off["num_prefixes"] == 6
    assert gpu["kv_cache_blocks"] >= 6 * 4 + 12 and gpu["host_kv_hits"] == 0 and on["host_kv_blocks"] == 36
    # The device-hit run finds every prefix after its first use; the tier gets them back from the host.
    assert gpu["prefix_hit_rate"] >= on["prefix_hit_rate"] > off["prefix_hit_rate"]
    assert on["host_kv_hits"] > 0 and on["same_hits_vs_gpu_hits"] > on["same_hits_vs_tier_off"]
    # Every block loaded back was checked, bit for bit, and none differed from what was spilled.
    assert on["copies_checked"] * 16 == on["host_kv_hits"] and on["copies_differing"] == 0
    # float32: the same tokens whichever run (bf16 on the GPU is where they may differ).
    assert on["same_tokens_vs_gpu_hits"] == on["same_tokens_vs_tier_off"] == 1.0
    assert on["same_tokens_of_same_hits_vs_gpu_hits"] == 1.0 and gpu["same_tokens_vs_tier_off"] == 1.0
    assert "copies_checked" not in gpu


def test_bench_copy_check_catches_loads_in_the_wrong_blocks(tiny_model_dir, monkeypatch, capsys):
    issue = KVSwapper.issue

    def reversed_loads(self, copies):
        # Each request's host blocks land in its device blocks in reverse order: a block id mix-up.
        for request_id, pairs in copies.loads.items():
            devices, hosts = zip(*pairs, strict=True)
            copies.loads[request_id] = list(zip(devices, hosts[::-1], strict=True))
        return issue(self, copies)

    monkeypatch.setattr(KVSwapper, "issue", reversed_loads)
    on = run_bench(tiny_model_dir, monkeypatch, capsys)["tier_on"]
    # The tiny model's few greedy tokens may not even change: the bitwise check is the sharper one.
    assert 0 < on["copies_differing"] <= on["copies_checked"]


class PendingEvent:
    """A load's event that the first few polls find pending, like a copy still running on its stream."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_no_step_reads_and_no_copy_reuses_a_block_while_a_load_into_it_is_in_flight(
    tiny_model_dir, monkeypatch
):
    """The ordering the CUDA streams rely on, checked in the engine's bookkeeping under shared-prefix
    traffic with slow loads and aborts: a block loading is in no step's block tables, is not spilled or
    loaded into again, and its host block is not overwritten by a spill, until its load is reported
    done; in the end every block is free and no host block is pinned."""
    from modelfleet.dataplane import LLM, SamplingParams

    in_flight: dict[str, list[tuple[int, int]]] = {}  # loads issued and not yet reported done

    def busy() -> tuple[set[int], set[int]]:
        pairs = [pair for loads in in_flight.values() for pair in loads]
        return {device for device, _ in pairs}, {host for _, host in pairs}

    issue, poll = KVSwapper.issue, KVSwapper.poll

    def slow_issue(self, copies):
        devices, hosts = busy()
        assert not {device for device, _ in copies.spills} & devices
        assert not {host for _, host in copies.spills} & hosts
        assert not {device for loads in copies.loads.values() for device, _ in loads} & devices
        in_flight.update(copies.loads)
        done = issue(self, copies)
        if done:
            self._in_flight.append((done, PendingEvent(2)))
        return []

    def tracking_poll(self):
        done = poll(self)
        for request_id in done:
            del in_flight[request_id]
        return done

    monkeypatch.setattr(KVSwapper, "issue", slow_issue)
    monkeypatch.setattr(KVSwapper, "poll", tracking_poll)
    # 12 blocks of 16 tokens (8 KiB each in float32), a host pool of 8: spills reuse host blocks.
    llm = LLM(
        tiny_model_dir,
        max_model_len=96,
        max_num_seqs=3,
        kv_cache_bytes=12 * 8192,
        host_kv_cache_bytes=8 * 8192,
        dtype="float32",
        device="cpu",
    )
    engine = llm.engine
    launch = engine.runner.launch
    steps_during_loads = 0

    def checked_launch(out, end_previous=None):
        nonlocal steps_during_loads
        devices, _ = busy()
        steps_during_loads += bool(devices)
        for item in out.scheduled:
            assert not set(item.seq.block_ids) & devices, item.seq.request_id
        return launch(out, end_previous)

    monkeypatch.setattr(engine.runner, "launch", checked_launch)
    rng = random.Random(1)
    prefixes = [[rng.randrange(16, 512) for _ in range(48)] for _ in range(6)]  # 18 blocks: 1.5x the cache
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    aborted = 0
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(16, 512) for _ in range(5)]
        engine.add_request(str(i), prompt, params, stream=False)
        if i % 7 == 6:  # one that may be loading now: its blocks must stay taken until the copies land
            loading = [request_id for request_id in in_flight if int(request_id) < i]
            if loading:
                engine.abort(loading[0])
                aborted += 1
        for _ in range(2):
            engine.step()
    while engine.has_unfinished_requests() or engine.host_tier.swapper.busy:
        engine.step()
    stats = engine.stats()
    assert stats.host_kv_hits > 0 and aborted > 0 and steps_during_loads > 0
    assert not in_flight and stats.num_free_blocks == 12
    assert not engine.host_tier.pool._pins
