"""A request whose next step needs its previous token on the host (penalties; a grammar's mask follows a
token in flight itself, engine/structured.py) makes the engine process that token before launching:
when the token ends the request (end of sequence), the request must leave the step being launched,
whose blocks it no longer has (alone in the step, the launch fails on its empty block table; beside
others, it would write into block 0, which it does not own)."""

from __future__ import annotations

import json

import pytest
from modelfleet.dataplane import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")


def test_an_end_of_sequence_seen_before_launch_leaves_the_step(llm):
    eos = min(llm.engine.eos_token_ids)
    ends_at_once = SamplingParams(
        max_tokens=8, repetition_penalty=1.3, logit_bias={eos: 100.0}, temperature=0
    )
    runs_on = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    short, long = llm.generate(["hello there", "and more"], [ends_at_once, runs_on])
    assert short.finish_reason == "stop" and short.token_ids == [eos]
    assert long.finish_reason == "length" and len(long.token_ids) == 8
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_grammar_requests_beside_plain_ones(llm):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    constrained = SamplingParams(max_tokens=40, structured=("json_schema", json.dumps(schema)), seed=3)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(["one", "two", "three"], [constrained, plain, constrained])
    for out in (outs[0], outs[2]):
        assert out.finish_reason == "stop" and json.loads(out.text)["a"] in ("x", "y")
    assert len(outs[1].token_ids) == 12
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.generate("x", SamplingParams(structured=("json_schema", '{"type": "nonsense"}')))
