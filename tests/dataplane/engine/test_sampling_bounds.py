"""Sampling parameters that would overflow inside a step are refused when the request is added, and a
refused request never harms the batch it would have joined."""

from __future__ import annotations

import pytest
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
)

# Each of these once overflowed in the engine step (int64 tensors, manual_seed, topk) and failed every
# request in the batch.
OUT_OF_RANGE = [
    ("seed", INT64_MAX + 1),
    ("seed", 1 << 64),
    ("seed", INT64_MIN - 1),
    ("top_k", INT64_MAX + 1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1 << 63),
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, max_model_len=128, kv_cache_bytes=1 << 21, dtype="float32", device="cpu")


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("seed", INT64_MAX), ("seed", INT64_MIN), ("logprobs", 20)])
def test_the_edges_of_each_range_are_accepted(llm, field, value):
    out = llm.generate("edge", SamplingParams(max_tokens=3, temperature=0.8, **{field: value}))[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_a_bad_value_set_after_construction_is_refused_at_add_and_the_batch_runs_on(llm, field, value):
    llm.add_request(f"good-{field}-{value}", "a normal request", SamplingParams(max_tokens=6, temperature=0))
    llm.step()  # the good request is in flight when the bad one arrives
    params = SamplingParams(max_tokens=6, temperature=1.0)
    setattr(params, field, value)  # a dataclass: nothing stops a caller from changing it
    with pytest.raises(ValueError, match=f"^{field}: "):
        llm.add_request(f"bad-{field}-{value}", "a bad request", params)
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [f"good-{field}-{value}"]
    assert finished[0].finish_reason == "length"


def test_top_k_above_the_vocabulary_keeps_every_token(llm):
    prompt, vocab = "same draw", llm.engine.vocab_size
    huge = llm.generate(prompt, SamplingParams(max_tokens=8, top_k=vocab * 1000, seed=7))[0]
    everything = llm.generate(prompt, SamplingParams(max_tokens=8, top_k=vocab, seed=7))[0]
    assert huge.token_ids == everything.token_ids


def test_stop_strings_are_bounded_in_number_and_length():
    SamplingParams(stop=["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match=r"^stop: at most 16 strings"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=r"^stop: at most"):
        SamplingParams(stop=["x" * (MAX_STOP_LENGTH + 1)])
