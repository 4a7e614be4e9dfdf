"""vLLM's metric names on a live server's /metrics (what the Gateway API Inference Extension's endpoint
picker and KEDA recipes scrape), with the values the requests and the engine produced."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

LABELS = {"model_name": "tiny", "version": "v1"}


def scrape(fleet) -> dict[str, float]:
    """Sample name -> value, for the samples labelled tiny@v1 (histogram buckets left out)."""
    text = httpx.get(f"{fleet.url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels == LABELS:
                values[sample.name] = sample.value
    return values


def test_vllm_names_and_values(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
    engine = fleet.engine("tiny", "v1")
    before, stats_before = scrape(fleet), engine.stats()
    prompt = " ".join(f"word{i}" for i in range(60))  # several full KV blocks: the second run hits them
    answers = [
        client.completions.create(
            model="tiny@v1", prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True}
        )
        for _ in range(2)
    ]
    after, stats = scrape(fleet), engine.stats()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    prompt_tokens = sum(a.usage.prompt_tokens for a in answers)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_prompt_tokens_count") == 2
    assert delta("vllm:request_generation_tokens_sum") == 8
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"vllm:{name}_count") == 2
        assert after[f"vllm:{name}_sum"] > before.get(f"vllm:{name}_sum", 0.0)
    # One gap between each two chunks: at most 3 per 4-token answer (tokens that piled up while the server
    # was busy arrive as one chunk), the same under both of vLLM's names.
    gaps = delta("vllm:inter_token_latency_seconds_count")
    assert gaps <= 6
    assert delta("vllm:time_per_output_token_seconds_count") == gaps

    # Engine counters, in tokens: every prompt token was looked up, the second run found its blocks.
    assert after["vllm:prefix_cache_queries_total"] == stats.prefix_cache_queries
    assert (
        delta("vllm:prefix_cache_queries_total")
        == stats.prefix_cache_queries - stats_before.prefix_cache_queries
    )
    assert delta("vllm:prefix_cache_queries_total") >= prompt_tokens
    assert delta("vllm:prefix_cache_hits_total") >= answers[1].usage.prompt_tokens // 2
    assert after["vllm:prefix_cache_hits_total"] == stats.prefix_cache_hits
    assert after["vllm:num_preemptions_total"] == stats.num_preemptions

    # Gauges, idle now, and the same as ours.
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == stats.kv_cache_usage
    text = httpx.get(f"{fleet.url}/metrics").text
    assert 'modelfleet_kv_cache_usage_ratio{model="tiny",version="v1"}' in text
