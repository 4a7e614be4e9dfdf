"""A step launches the next batch before it reads back the previous one's tokens (the host's work
overlaps the device's). What that must not change: tokens, stop handling, blocks, penalties."""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.block_manager import BlockManager
from modelfleet.dataplane.engine.scheduler import Scheduler
from modelfleet.dataplane.engine.sequence import Sequence, SequenceStatus

from .hf_checkpoints import make_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("overlap") / "llama", "llama3.2-tied")


@pytest.fixture
def llm(model_dir) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_bytes=1 << 22)


def record_launches(llm: LLM) -> list[tuple]:
    """Events in order: ("launch", {request_id: samples}) and ("result", step number)."""
    events: list[tuple] = []
    runner = llm.engine.runner
    launch = runner.launch

    def recording_launch(out, end_previous=None):
        launched = launch(out, end_previous)
        number = sum(1 for e in events if e[0] == "launch")
        events.append(("launch", {s.seq.request_id: s.samples for s in out.scheduled}))
        result = launched.result

        def recording_result():
            events.append(("result", number))
            return result()

        launched.result = recording_result
        return launched

    runner.launch = recording_launch
    return events


def test_next_step_is_launched_before_the_previous_tokens_are_read(llm):
    events = record_launches(llm)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, **GREEDY))
    results = [e[1] for e in events if e[0] == "result"]
    assert results == sorted(results) and len(results) == 6
    # Every result but the last is read after the step that follows it was launched.
    for n in results[:-1]:
        position = events.index(("result", n))
        assert sum(1 for e in events[:position] if e[0] == "launch") == n + 2


def test_tokens_equal_one_at_a_time_runs(llm, model_dir):
    """Batched, overlapped outputs equal each prompt run alone (with its own engine)."""
    prompts = [[5, 6, 7], list(range(10, 60)), [8], list(range(100, 117))]
    params = SamplingParams(max_tokens=12, **GREEDY)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    for prompt, tokens in zip(prompts, batched, strict=True):
        alone = LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_bytes=1 << 22)
        assert alone.generate(prompt, params)[0].token_ids == tokens


def test_a_stop_token_ends_the_request_there_and_its_extra_row_is_thrown_away(llm):
    free = llm.stats().num_free_blocks
    reference = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
    stop_at = reference[3]
    cut = reference.index(stop_at)  # the first occurrence ends it
    events = record_launches(llm)
    stopped, other = llm.generate(
        [[5, 6, 7], [5, 6, 7]],
        [
            SamplingParams(max_tokens=10, stop_token_ids=[stop_at], **GREEDY),
            SamplingParams(max_tokens=10, **GREEDY),
        ],
    )
    assert stopped.token_ids == reference[: cut + 1] and stopped.finish_reason == "stop"
    assert other.token_ids == reference and other.finish_reason == "length"
    rows = [e[1] for e in events if e[0] == "launch"]
    sampled_for = {rid: sum(1 for r in rows if r.get(rid)) for rid in ("generate-1", "generate-2")}
    # The stopped request: its tokens, plus at most the one row launched before its stop was seen.
    assert cut + 1 <= sampled_for["generate-1"] <= cut + 2
    # A length limit is known ahead: no row is computed past max_tokens.
    assert sampled_for["generate-2"] == 10
    assert llm.stats().num_free_blocks == free


def test_repetition_penalty_sees_every_token_as_hugging_face_does(llm, model_dir):
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 5, 6]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    plain = SamplingParams(max_tokens=16, **GREEDY)
    ours, _ = llm.generate([prompt, [9, 10, 11]], [params, plain])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8, pad_token_id=0
        )
    assert ours.token_ids == out[0, len(prompt) :].tolist()


def make_scheduler(num_blocks: int = 8, prefix_caching: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
    )


def test_a_sequence_whose_last_token_is_in_flight_is_not_planned_again():
    sched = make_scheduler()
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
    sched.add(seq)
    first = sched.schedule()  # prefill: samples output 1
    second = sched.schedule()  # decode of output 1 (in flight): samples output 2, the last
    assert [s.samples for s in first.scheduled + second.scheduled] == [True, True]
    assert seq.num_inflight == 2 and seq.num_computed_tokens == 4
    assert sched.schedule().is_empty
    sched.update(first, [11])
    sched.update(second, [12])
    assert seq.output_token_ids == [11, 12] and seq.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 8


def test_a_sequence_preempted_with_a_token_in_flight_gets_it_and_is_recomputed():
    sched = make_scheduler(prefix_caching=False)
    seq = Sequence("a", [1, 2, 3, 4], SamplingParams(max_tokens=8, **GREEDY))
    sched.add(seq)
    prefill = sched.schedule()
    sched._preempt(sched.running.pop())  # e.g. the KV cache ran out while its token was in flight
    assert seq.status is SequenceStatus.PREEMPTED and seq.num_inflight == 1
    assert sched.schedule().is_empty  # not recomputed before its token is known
    sched.update(prefill, [21])
    assert seq.token_ids == [1, 2, 3, 4, 21] and seq.num_inflight == 0
    again = sched.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in again.scheduled] == [(0, 5, True)]


def test_a_block_is_named_for_the_prefix_cache_only_once_its_tokens_are_known():
    sched = make_scheduler()
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8, **GREEDY))
    sched.add(seq)
    prefill = sched.schedule()  # 3 tokens; output 1 in flight would be the 4th of the first block
    decode = sched.schedule()
    assert seq.num_computed_tokens == 4 and sched.block_manager._num_registered.get("a", 0) == 0
    sched.update(prefill, [7])
    sched.update(decode, [8])
    sched.schedule()
    assert seq.block_hashes[0] == hash((None, (1, 2, 3, 7)))
    assert sched.block_manager.cached_block_id(seq.block_hashes[0]) == seq.block_ids[0]
