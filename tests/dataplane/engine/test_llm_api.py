"""The offline API on the tiny demo model: text, stops, bad input, seeds, abort, failures, priorities."""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane import LLM, EngineConfig, SamplingParams
from modelfleet.dataplane.config import (
    GRAPHED_TOKEN_BUDGET_MAX,
    PREFILL_WAIT_STEPS,
    TOKEN_BUDGET,
    token_budget,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")


def run_until_done(llm: LLM) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_generate_returns_text_tokens_and_finish_reason_in_prompt_order(llm):
    prompts = ["Hello there", "The model server", [5, 6, 7, 8]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert [o.prompt_token_ids for o in outs][2] == [5, 6, 7, 8]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("Hello there")
    for out in outs:
        assert out.finished and out.finish_reason == "length" and len(out.token_ids) == 12
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.arrival_time <= out.first_token_time <= out.finished_time


def test_streamed_deltas_add_up_to_the_final_output(llm):
    llm.add_request("stream", "Once upon a time", SamplingParams(max_tokens=20, **GREEDY))
    outputs = run_until_done(llm)["stream"]
    final = outputs[-1]
    assert final.finished and not any(o.finished for o in outputs[:-1])
    assert "".join(o.new_text for o in outputs) == final.text
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids


@pytest.mark.parametrize("with_stop", [False, True])
def test_delta_outputs_carry_only_what_is_new_and_add_up_to_the_cumulative_ones(llm, with_stop):
    prompt = "A stop string test"
    stop = None
    if with_stop:
        stop = [llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))[0].text[10:13]]
    kinds = {
        kind: SamplingParams(max_tokens=24, logprobs=2, stop=stop, output_kind=kind, **GREEDY)
        for kind in ("cumulative", "delta")
    }
    for kind, params in kinds.items():
        llm.add_request(kind, prompt, params)
    outputs = run_until_done(llm)
    cumulative, deltas = outputs["cumulative"][-1], outputs["delta"]
    assert all(o.delta and o.prompt_token_ids == [] for o in deltas)
    assert all(o.text == o.new_text and o.token_ids == o.new_token_ids for o in deltas)
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in deltas)
    assert "".join(o.text for o in deltas) == cumulative.text
    assert [t for o in deltas for t in o.token_ids] == cumulative.token_ids
    assert [lp for o in deltas for lp in o.logprobs] == cumulative.logprobs
    assert deltas[-1].finish_reason == cumulative.finish_reason == ("stop" if with_stop else "length")
    assert not cumulative.delta and cumulative.prompt_token_ids == llm.tokenizer.encode(prompt)


def test_stop_string_truncates_the_text_and_stops(llm):
    params = SamplingParams(max_tokens=24, **GREEDY)
    full = llm.generate("A stop string test", params)[0].text
    stop = full[10:13]
    assert stop and full.find(stop) >= 0
    out = llm.generate("A stop string test", SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    assert len(out.token_ids) < 24


def test_stop_token_id_ends_generation_including_that_token(llm):
    full = llm.generate([9, 10, 11], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
    stop_id = full[4]
    cut = full.index(stop_id)
    out = llm.generate([9, 10, 11], SamplingParams(max_tokens=10, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: cut + 1]


def test_eos_stops_unless_ignored(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=128, kv_cache_bytes=1 << 21, dtype="float32", device="cpu")
    full = llm.generate([20, 21], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    llm.engine.eos_token_ids = frozenset({full[3]})
    cut = full.index(full[3])
    out = llm.generate([20, 21], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: cut + 1]
    ignored = llm.generate([20, 21], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert ignored.token_ids == full


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1] * 256, {}, "prompt"),
        ([1, 99999], {}, "prompt"),
        ("hi", {"temperature": -0.5}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"output_kind": "diff"}, "output_kind"),
    ],
)
def test_bad_input_is_refused_when_added_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.add_request("bad", prompt, SamplingParams(**params) if params else None)
    assert not llm.has_unfinished_requests()


def test_one_bad_prompt_refuses_the_whole_generate_call(llm):
    with pytest.raises(ValueError, match=r"^prompt:"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_and_batch_independent(llm, tiny_model_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Seeded prompt"], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s) for s in (None, 1, 2)]
    batch = llm.generate(
        ["Another prompt", "Seeded prompt", "More text here", "x"],
        [others[0], seeded, others[1], others[2]],
    )
    assert batch[1].token_ids == alone
    fresh = LLM(tiny_model_dir, max_model_len=128, kv_cache_bytes=1 << 21, dtype="float32", device="cpu")
    assert fresh.generate("Seeded prompt", seeded)[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=16, ignore_eos=True)
    assert llm.generate("Seeded prompt", different_seed)[0].token_ids != alone


def test_abort_frees_blocks_at_once_and_others_go_on(llm):
    total = llm.stats().num_total_blocks
    llm.add_request("keep", [3, 4, 5], SamplingParams(max_tokens=6, **GREEDY))
    llm.add_request("drop", list(range(5, 105)), SamplingParams(max_tokens=50, **GREEDY))
    llm.step()
    assert llm.stats().num_free_blocks == total - 1 - 7
    final = llm.abort("drop")
    assert final.finished and final.finish_reason == "abort"
    assert llm.stats().num_free_blocks == total - 1
    assert llm.abort("drop") is None
    outputs = run_until_done(llm)
    assert outputs["keep"][-1].finish_reason == "length" and "drop" not in outputs
    assert llm.stats().num_free_blocks == total


def test_nan_logits_fail_only_that_request(llm, monkeypatch):
    sampler = llm.engine.runner.sampler
    original = type(sampler).begin

    def poisoned(self, logits, seqs, **kwargs):
        logits = logits.clone()
        for i, seq in enumerate(seqs):
            # The token being sampled is the last of those in flight: poison the third.
            if seq.request_id == "poisoned" and seq.num_output_tokens + seq.num_inflight == 3:
                logits[i, 0] = float("nan")
        return original(self, logits, seqs, **kwargs)

    monkeypatch.setattr(type(sampler), "begin", poisoned)
    llm.add_request("poisoned", [7, 8, 9], SamplingParams(max_tokens=8, **GREEDY))
    llm.add_request("healthy", [7, 8, 9], SamplingParams(max_tokens=8, **GREEDY))
    outputs = run_until_done(llm)
    bad, good = outputs["poisoned"][-1], outputs["healthy"][-1]
    assert bad.finish_reason == "error" and "NaN" in bad.error and len(bad.token_ids) == 2
    assert good.finish_reason == "length" and len(good.token_ids) == 8 and good.error is None
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_priority_runs_lower_values_first(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=64, max_num_seqs=1, kv_cache_bytes=1 << 20, device="cpu")
    params = SamplingParams(max_tokens=2, **GREEDY)
    llm.add_request("background", [1, 2], params, priority=10)
    llm.add_request("urgent", [1, 3], params, priority=-5)
    llm.add_request("normal", [1, 4], params)
    finished = [o.request_id for o in _finished_in_order(llm)]
    assert finished == ["urgent", "normal", "background"]


def _finished_in_order(llm: LLM) -> list:
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    return done


def test_logprobs_and_prefix_cache_stats(llm):
    prompt = list(range(10, 60))
    params = SamplingParams(max_tokens=3, logprobs=2, **GREEDY)
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens == 48
    assert all(
        len(lp) in (2, 3) and tok in lp for lp, tok in zip(first.logprobs, first.token_ids, strict=True)
    )
    stats = llm.stats()
    assert 0 < stats.prefix_cache_hit_rate <= 1 and stats.num_running == stats.num_waiting == 0


def test_engine_config_refuses_bad_settings(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"^max_num_seqs:"):
        EngineConfig(model=str(tiny_model_dir), max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^kv_cache_memory_fraction:"):
        EngineConfig(model=str(tiny_model_dir), kv_cache_memory_fraction=1.5)
    with pytest.raises(ValueError, match=r"^model:"):
        EngineConfig(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens:"):
        EngineConfig(
            model=str(tiny_model_dir),
            enable_chunked_prefill=False,
            max_model_len=4096,
            max_num_batched_tokens=2048,
        )
    with pytest.raises(ValueError, match=r"^no_such_setting:"):
        LLM(tiny_model_dir, no_such_setting=1)
    with pytest.raises(ValueError, match=r"^max_model_len:"):
        LLM(tiny_model_dir, max_model_len=10**6)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"^prefill_wait_steps:"):
            EngineConfig(model=str(tiny_model_dir), prefill_wait_steps=bad)


def test_a_steps_token_budget_grows_with_the_sequence_slots_only_where_decodes_replay_cuda_graphs():
    assert token_budget(None, 512, decode_graphs=False) == TOKEN_BUDGET == 2048
    assert [token_budget(None, n, decode_graphs=True) for n in (16, 64, 128, 256, 512, 4096)] == [
        2048, 2048, 2048, 4096, 8192, GRAPHED_TOKEN_BUDGET_MAX,
    ]  # fmt: skip
    assert token_budget(1000, 512, decode_graphs=True) == 1000  # a configured budget stands as it is
    # Unchunked prompts must fit whole into a step.
    assert token_budget(None, 64, decode_graphs=False, whole_prompt=32768) == 32768
    assert token_budget(None, 512, decode_graphs=True, whole_prompt=4096) == 8192


def test_the_engine_schedules_under_its_token_budget(tiny_model_dir):
    settings = dict(max_model_len=128, kv_cache_bytes=1 << 21, dtype="float32", device="cpu")
    default = LLM(tiny_model_dir, max_num_seqs=512, **settings).engine
    assert default.max_num_batched_tokens == default.scheduler.max_num_batched_tokens == 2048  # no graphs
    engine = LLM(tiny_model_dir, max_num_batched_tokens=96, **settings).engine
    params = SamplingParams(max_tokens=2, **GREEDY)
    for i in range(2):
        engine.add_request(f"r{i}", list(range(20 + i, 84 + i)), params, stream=False)
    planned = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in planned.scheduled] == [64, 32]  # the second prompt's first chunk


def test_waiting_requests_are_held_by_default_only_where_decodes_replay_cuda_graphs(tiny_model_dir):
    settings = dict(max_model_len=128, kv_cache_bytes=1 << 21, dtype="float32", device="cpu")
    plain = LLM(tiny_model_dir, **settings)
    assert plain.engine.scheduler.prefill_wait_steps == 0  # no graphs on the CPU
    held = LLM(tiny_model_dir, prefill_wait_steps=3, **settings)
    assert held.engine.scheduler.prefill_wait_steps == 3
    # A request arriving while another decodes waits 3 steps, then joins; held or not, greedy answers
    # are the same: holding changes when a request starts, not what it says.
    plain_steps, plain_tokens = arrive_while_decoding(plain)
    held_steps, held_tokens = arrive_while_decoding(held)
    assert (plain_steps, held_steps) == (1, 4)
    assert held_tokens == plain_tokens
    assert sorted(held_tokens) == ["first", "second"] and all(len(t) == 12 for t in held_tokens.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_decode_graphs_hold_waiting_requests_by_default(tiny_model_dir):
    settings = dict(max_model_len=128, kv_cache_memory_fraction=0.05, dtype="float32", device="cuda")
    graphs = LLM(tiny_model_dir, **settings)
    assert graphs.engine.runner.decode_graphs is not None
    assert graphs.engine.scheduler.prefill_wait_steps == PREFILL_WAIT_STEPS
    assert graphs.engine.scheduler.max_num_batched_tokens == token_budget(None, 64, decode_graphs=True)
    assert arrive_while_decoding(graphs)[0] == PREFILL_WAIT_STEPS + 1
    del graphs  # each engine takes a small share of the GPU's memory: both fit anyway
    eager = LLM(tiny_model_dir, enforce_eager=True, **settings)
    assert eager.engine.runner.decode_graphs is None
    assert eager.engine.scheduler.prefill_wait_steps == 0


def arrive_while_decoding(llm: LLM) -> tuple[int, dict[str, list[int]]]:
    """Steps taken until a request added while another decodes leaves the waiting queue, and every
    request's tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=12, **GREEDY)
    engine.add_request("first", "once upon a time", params, stream=False)
    outputs = engine.step() + engine.step()  # its prefill, then a decode
    engine.add_request("second", "the cat", params, stream=False)
    steps = 0
    while engine.scheduler.waiting:
        outputs += engine.step()
        steps += 1
    while engine.has_unfinished_requests() or engine._launched is not None:
        outputs += engine.step()
    return steps, {o.request_id: o.token_ids for o in outputs if o.finished}


def test_kv_cache_is_sized_from_the_byte_budget_and_logged(tiny_model_dir, caplog):
    import torch
    from modelfleet.dataplane.models import ModelConfig, kv_cache_block_bytes

    block_bytes = kv_cache_block_bytes(ModelConfig.from_dir(tiny_model_dir), 16, torch.float32)
    with caplog.at_level("INFO", logger="modelfleet.dataplane.engine.model_runner"):
        llm = LLM(tiny_model_dir, kv_cache_bytes=37 * block_bytes + 5, dtype="float32", device="cpu")
    runner = llm.engine.runner
    assert runner.num_blocks == 37 and llm.stats().num_total_blocks == 37
    assert runner.kv_cache_bytes == 37 * block_bytes
    assert "KV cache: 37 blocks of 16 tokens" in caplog.text
    # A request can never outgrow the whole cache: the usable length shrinks to what it holds.
    assert llm.engine.max_model_len == 37 * 16
    # A budget larger than every sequence at full length could fill is not allocated.
    capped = LLM(tiny_model_dir, max_model_len=64, max_num_seqs=2, kv_cache_bytes=1 << 30, device="cpu")
    assert capped.engine.runner.num_blocks == 2 * 4
    with pytest.raises(ValueError, match=r"^kv_cache_bytes:"):
        LLM(tiny_model_dir, kv_cache_bytes=block_bytes - 1, dtype="float32", device="cpu")


def test_warm_up_leaves_no_trace(tiny_model_dir):
    """GPU engines warm up at start (kernels compiled before the first request); afterwards the engine
    is as if new: no requests, blocks all free, no cached prefix, no statistics, same greedy tokens."""
    settings = dict(device="cpu", max_model_len=256, max_num_batched_tokens=64, kv_cache_bytes=1 << 22)
    llm = LLM(tiny_model_dir, **settings)
    llm.engine._warm_up()
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert stats.prefix_cache_hit_rate == 0.0 and stats.num_preemptions == 0
    assert not llm.engine.block_manager._cached  # nothing the warm-up computed is found again
    params = SamplingParams(max_tokens=8, **GREEDY)
    fresh = LLM(tiny_model_dir, **settings)
    assert (
        llm.generate("Once upon a time", params)[0].token_ids
        == fresh.generate("Once upon a time", params)[0].token_ids
    )
