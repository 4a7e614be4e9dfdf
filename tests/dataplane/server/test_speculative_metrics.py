"""Speculative decoding's figures on /metrics, per version: acceptance and mean accepted length, and
vLLM's counters, read from each engine's stats."""

from __future__ import annotations

from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.server.metrics import ServerMetrics


def test_each_version_exports_its_own_acceptance(tiny_model_dir):
    spec = LLM(
        tiny_model_dir, device="cpu", dtype="float32", speculative_proposer="ngram", num_speculative_tokens=3
    )
    plain = LLM(tiny_model_dir, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 6
    for llm in (spec, plain):
        llm.generate([prompt], params)
    metrics = ServerMetrics(lambda: [("m", "spec", spec.engine), ("m", "plain", plain.engine)])
    metrics.render()
    get = metrics.registry.get_sample_value
    stats = spec.stats()
    assert stats.spec_num_draft_tokens > 0
    ours, vllm = {"model": "m", "version": "spec"}, {"model_name": "m", "version": "spec"}
    assert get("modelfleet_spec_decode_acceptance_ratio", ours) == stats.spec_acceptance_rate
    assert get("modelfleet_spec_decode_mean_accepted_length", ours) == stats.spec_mean_accepted_length
    assert get("vllm:spec_decode_num_draft_tokens_total", vllm) == stats.spec_num_draft_tokens
    assert get("vllm:spec_decode_num_accepted_tokens_total", vllm) == stats.spec_num_accepted_tokens
    assert get("vllm:spec_decode_num_drafts_total", vllm) == stats.spec_num_drafts
    # The plain version reports none.
    assert get("modelfleet_spec_decode_acceptance_ratio", {"model": "m", "version": "plain"}) == 0.0
    assert get("vllm:spec_decode_num_draft_tokens_total", {"model_name": "m", "version": "plain"}) == 0.0
