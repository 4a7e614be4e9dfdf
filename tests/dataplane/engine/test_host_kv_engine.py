"""The host KV tier in the engine, on the CPU (the host pool is a second pool beside the CPU's KV cache):
the same greedy tokens with the tier on and off while prefixes twice the KV cache come and go, hits and
spills counted, and nothing lost when the host pool is full."""

from __future__ import annotations

import random
import time

import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.host_kv import Copies, KVSwapper

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16
BLOCK_BYTES = 8192  # the tiny model's float32 block of 16 tokens
NUM_BLOCKS = 16
PREFIX_BLOCKS = 4
NUM_PREFIXES = 8  # 32 blocks of prefixes: twice the KV cache


def make_llm(model_dir, host_blocks: int, device: str = "cpu") -> LLM:
    # On a GPU the KV cache is capped by what max_num_seqs sequences of max_model_len tokens fill.
    return LLM(
        model_dir,
        max_model_len=NUM_BLOCKS * BLOCK // 2 if device == "cuda" else 256,
        max_num_seqs=2,
        kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES,
        host_kv_cache_bytes=host_blocks * BLOCK_BYTES,
        dtype="float32",
        device=device,
    )


def workload() -> list[list[list[int]]]:
    """Rounds of two requests each: every prefix twice, with different suffixes, the second time after
    the others have pushed it out of the KV cache."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(4, 512) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(NUM_PREFIXES)]
    order = list(range(NUM_PREFIXES)) * 2
    prompts = [prefixes[i] + [rng.randrange(4, 512) for _ in range(5)] for i in order]
    return [prompts[i : i + 2] for i in range(0, len(prompts), 2)]


def run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for batch in workload():
        tokens += [out.token_ids for out in llm.generate(batch, params)]
    return tokens


@pytest.fixture(scope="module")
def tokens_without_tier(tiny_model_dir) -> list[list[int]]:
    llm = make_llm(tiny_model_dir, host_blocks=0)
    assert llm.engine.host_tier is None
    tokens = run(llm)
    # The second round recomputes: its prefixes have left the KV cache.
    assert llm.stats().prefix_cache_hits == 0
    return tokens


def test_tier_gives_the_same_tokens_and_turns_evictions_into_hits(tiny_model_dir, tokens_without_tier):
    llm = make_llm(tiny_model_dir, host_blocks=64)
    assert run(llm) == tokens_without_tier
    stats = llm.stats()
    # Every prefix of the second round came back from the host: 8 prefixes of 4 blocks.
    assert stats.host_kv_hits == NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
    assert stats.prefix_cache_hits == stats.host_kv_hits
    assert stats.host_kv_spills >= NUM_PREFIXES * PREFIX_BLOCKS
    assert stats.num_free_blocks == NUM_BLOCKS


def test_a_full_host_pool_loses_hits_but_no_tokens(tiny_model_dir, tokens_without_tier):
    llm = make_llm(tiny_model_dir, host_blocks=20)  # fewer than the prefixes need
    assert run(llm) == tokens_without_tier
    stats = llm.stats()
    assert len(llm.engine.host_tier.pool) == 20
    assert 0 < stats.host_kv_hits < NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
    assert stats.num_free_blocks == NUM_BLOCKS


class SlowEvent:
    """An event that a few polls find still pending, like a copy on a side stream."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_requests_waiting_for_copies_leave_the_batch_running(
    tiny_model_dir, tokens_without_tier, monkeypatch
):
    issue = KVSwapper.issue

    def slow_issue(self, copies):
        done = issue(self, copies)
        if done:
            self._in_flight.append((done, SlowEvent(3)))
        return []

    monkeypatch.setattr(KVSwapper, "issue", slow_issue)
    llm = make_llm(tiny_model_dir, host_blocks=64)
    block_manager, scheduler = llm.engine.block_manager, llm.engine.scheduler
    schedule = scheduler.schedule
    steps = []  # (requests loading, requests scheduled) per step

    def recording_schedule():
        out = schedule()
        steps.append((len(block_manager._loading), len(out.scheduled)))
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    assert run(llm) == tokens_without_tier
    assert llm.stats().host_kv_hits == NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
    # The first prefix is on the host only now: a request with it waits for its copies while a request
    # that hits nothing, queued after it, runs.
    steps.clear()
    batch = [[*workload()[0][0][: PREFIX_BLOCKS * BLOCK], 9, 9, 9], [5] * 40]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [out.token_ids for out in llm.generate(batch, params)]
    assert steps[0] == (1, 1)
    assert not llm.engine.host_tier.swapper.busy
    assert got == [out.token_ids for out in make_llm(tiny_model_dir, host_blocks=0).generate(batch, params)]


def test_the_tokens_depend_on_the_copies(tiny_model_dir, tokens_without_tier, monkeypatch):
    """The check above can fail: loads that copy nothing leave other prefixes' keys in the blocks."""
    issue = KVSwapper.issue

    def spills_only(self, copies):
        done = list(copies.loads)
        copies.loads = {}
        issue(self, copies)
        return done

    monkeypatch.setattr(KVSwapper, "issue", spills_only)
    llm = make_llm(tiny_model_dir, host_blocks=64)
    assert llm.stats().host_kv_hits == 0
    assert run(llm) != tokens_without_tier
    assert llm.stats().host_kv_hits > 0


def test_host_tier_setting_is_checked(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^host_kv_cache_bytes:"):
        make_llm(tiny_model_dir, host_blocks=-1)
    with pytest.raises(ValueError, match=r"^host_kv_cache_bytes: 100 bytes hold no KV block"):
        LLM(tiny_model_dir, kv_cache_bytes=1 << 20, host_kv_cache_bytes=100, dtype="float32", device="cpu")


def test_host_tier_counters_are_on_the_servers_metrics(tiny_model_dir):
    from modelfleet.dataplane.server.metrics import _EngineCollector

    llm = make_llm(tiny_model_dir, host_blocks=64)
    run(llm)
    stats = llm.stats()
    collector = _EngineCollector(lambda: [("tiny", "v1", llm.engine)])
    samples = {
        sample.name: sample.value
        for family in collector.collect()
        for sample in family.samples
        if sample.labels == {"model": "tiny", "version": "v1"}
    }
    assert samples["modelfleet_host_kv_hits_total"] == stats.host_kv_hits > 0
    assert samples["modelfleet_host_kv_spills_total"] == stats.host_kv_spills > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda_only])])
def test_swapper_copies_a_block_out_and_back(device):
    # (num_layers, 2, num_blocks, block_size, heads, head_dim)
    kv = torch.randn(2, 2, 4, BLOCK, 2, 8, device=device)
    swapper = KVSwapper(kv, num_host_blocks=3)
    assert swapper.host.is_pinned() == (device == "cuda")
    expected = kv[:, :, 1].clone()
    swapper.issue(Copies(spills=[(1, 2)]))
    kv[:, :, 1] = 0  # the block is reused
    done = swapper.issue(Copies(loads={"r": [(3, 2)]}))
    deadline = time.monotonic() + 30
    while not done:
        assert time.monotonic() < deadline
        done = swapper.poll()
    assert done == ["r"] and not swapper.busy
    torch.testing.assert_close(kv[:, :, 3], expected, rtol=0, atol=0)


@pytest.mark.gpu
@cuda_only
def test_tier_on_gpu_gives_the_same_tokens(tiny_llama_dir):
    """Spills on the compute stream, loads on the copy stream with events, CUDA graphs for decodes."""
    tokens = run(make_llm(tiny_llama_dir, host_blocks=0, device="cuda"))
    llm = make_llm(tiny_llama_dir, host_blocks=64, device="cuda")
    assert llm.engine.runner.num_blocks == NUM_BLOCKS
    assert llm.engine.host_tier.swapper.stream is not None
    assert run(llm) == tokens
    assert llm.stats().host_kv_hits == NUM_PREFIXES * PREFIX_BLOCKS * BLOCK


def test_serve_engine_flag_sets_the_host_tier(tiny_model_dir):
    from modelfleet.dataplane import EngineConfig
    from modelfleet.dataplane.server.cli import _engine_settings

    settings = _engine_settings(["host_kv_cache_bytes=4194304"])  # modelfleet serve --engine ...
    assert EngineConfig.from_kwargs(tiny_model_dir, **settings).host_kv_cache_bytes == 4 << 20
    assert EngineConfig(str(tiny_model_dir)).host_kv_cache_bytes == 0  # off by default
