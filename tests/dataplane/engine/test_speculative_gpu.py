"""Speculative decoding on a GPU: verify steps (several query rows per sequence through the prefill
kernels) and a draft model's KV cache give the plain engine's greedy tokens (float32 on both)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_greedy_tokens_equal_plain_on_the_gpu(tiny_llama_dir, proposer):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from modelfleet.dataplane import LLM, SamplingParams

    g = torch.Generator().manual_seed(3)
    loop = torch.randint(5, 500, (9,), generator=g).tolist()
    shared = torch.randint(5, 500, (70,), generator=g).tolist()
    prompts = [loop * 8, [*shared, 1, 2], [*shared, 3], torch.randint(5, 500, (40,), generator=g).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    settings = dict(device="cuda", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4)
    want = [o.token_ids for o in LLM(tiny_llama_dir, **settings).generate(prompts, params)]
    extra: dict = dict(speculative_proposer=proposer, num_speculative_tokens=4)
    if proposer == "draft":  # the target as its own draft: every draft should be accepted
        extra["speculative_draft_model"] = str(tiny_llama_dir)
    spec = LLM(tiny_llama_dir, **settings, **extra)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.stats()
    assert stats.spec_num_draft_tokens > 0
    if proposer == "draft":
        assert stats.spec_acceptance_rate > 0.95
