"""Greedy tokens and logprobs against Hugging Face transformers, per architecture and engine mode.

Each architecture gets a tiny random-weight float32 checkpoint (conftest.py). The reference is batched
`generate` with left padding; our engine must produce the same 32 greedy tokens for every prompt, with
a whole-prompt prefill, under preemption, with prefix caching and with chunked prefill.
"""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams

from .hf_checkpoints import ARCHITECTURES

NEW_TOKENS = 32
NUM_LOGPROBS = 5
# float32 on both sides; the paged attention sums in another order than Hugging Face's eager attention.
LOGPROB_ATOL = 1e-3


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(5, 512, (n,), generator=g).tolist()

    long = rand(300)
    mid = rand(64)
    prompts = [
        rand(1),
        rand(23),
        mid,
        long,
        long[:200] + rand(37),  # shares 200 tokens with `long`
        long[:128] + rand(1),  # shares 8 full blocks
        mid + rand(90),  # shares all of `mid`
        rand(150),
        rand(2),
    ]
    return prompts


PROMPTS = make_prompts()


def hf_greedy(model_dir) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Tokens and per-step log-probabilities [NEW_TOKENS, vocab] from transformers' generate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[:, width:].tolist()
    logprobs = torch.stack(out.logits, dim=1).log_softmax(dim=-1)
    return tokens, list(logprobs)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def reference(request, hf_checkpoints):
    model_dir = hf_checkpoints[request.param]
    tokens, logprobs = hf_greedy(model_dir)
    return model_dir, tokens, logprobs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS)


def engine(model_dir, **overrides) -> LLM:
    settings = dict(
        dtype="float32",
        device="cpu",
        max_model_len=512,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=512,
    )
    settings.update(overrides)
    return LLM(model_dir, **settings)


def assert_matches(outputs, hf_tokens, hf_logprobs) -> None:
    for i, (out, tokens, ref_lp) in enumerate(zip(outputs, hf_tokens, hf_logprobs, strict=True)):
        assert out.token_ids == tokens, f"prompt {i} (length {len(PROMPTS[i])}): tokens differ"
        assert out.finish_reason == "length"
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert len(lp) == NUM_LOGPROBS  # the chosen greedy token is among the top 5
            for token_id, value in lp.items():
                expected = ref_lp[step, token_id].item()
                assert abs(value - expected) < LOGPROB_ATOL, (i, step, token_id, value, expected)
            assert max(lp, key=lp.get) == token


def record_plans(llm: LLM) -> list[list[tuple[str, int, int]]]:
    """Wraps the scheduler so the test can see how each step was planned."""
    plans: list[list[tuple[str, int, int]]] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        plans.append([(s.seq.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled])
        return out

    llm.engine.scheduler.schedule = recording_schedule
    return plans


def test_whole_prompt_prefill_matches(reference):
    model_dir, hf_tokens, hf_logprobs = reference
    llm = engine(model_dir)
    assert_matches(llm.generate(PROMPTS, GREEDY), hf_tokens, hf_logprobs)


def test_matches_under_preemption(reference):
    from modelfleet.dataplane.models import ModelConfig, kv_cache_block_bytes

    model_dir, hf_tokens, hf_logprobs = reference
    block_bytes = kv_cache_block_bytes(ModelConfig.from_dir(model_dir), 16, torch.float32)
    # 24 blocks hold the longest request (332 tokens = 21 blocks) but not the batch (about 90 blocks).
    llm = engine(model_dir, kv_cache_bytes=24 * block_bytes, enable_chunked_prefill=True)
    assert llm.engine.block_manager.num_blocks == 24
    assert_matches(llm.generate(PROMPTS, GREEDY), hf_tokens, hf_logprobs)
    assert llm.stats().num_preemptions > 0
    assert llm.stats().num_free_blocks == 24


def test_matches_with_prefix_caching(reference):
    model_dir, hf_tokens, hf_logprobs = reference
    llm = engine(model_dir, enable_prefix_caching=True)
    first = llm.generate(PROMPTS, GREEDY)
    assert_matches(first, hf_tokens, hf_logprobs)
    # Prompts sharing a prefix with one admitted before them hit its blocks in the first run already.
    assert first[4].num_cached_tokens == 192 and first[6].num_cached_tokens == 64
    second = llm.generate(PROMPTS, GREEDY)
    assert_matches(second, hf_tokens, hf_logprobs)
    assert second[3].num_cached_tokens == 288  # all full blocks but the last token's
    assert llm.stats().prefix_cache_hit_rate > 0.4


def test_matches_with_chunked_prefill(reference):
    model_dir, hf_tokens, hf_logprobs = reference
    llm = engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=48)
    plans = record_plans(llm)
    assert_matches(llm.generate(PROMPTS, GREEDY), hf_tokens, hf_logprobs)
    assert all(sum(n for _, _, n in plan) <= 48 for plan in plans)
    long_id = "generate-3"
    chunks = [(start, n) for plan in plans for rid, start, n in plan if rid == long_id and start < 300]
    assert len(chunks) >= 300 // 48 and chunks[0][0] == 0
    # Some step mixes a decode with a prefill chunk.
    assert any(any(n == 1 for *_, n in plan) and any(n > 1 for *_, n in plan) for plan in plans)
