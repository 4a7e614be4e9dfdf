"""Streamed tokens are counted once per engine output (StreamCounts), and /metrics still shows what
prometheus_client's Histogram and Counter showed when every token was observed on its own."""

from __future__ import annotations

import random

from modelfleet.dataplane.server.metrics import _LATENCY_BUCKETS, LABELS, VLLM_LABELS, ServerMetrics
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

ITL_NAMES = (
    ("modelfleet_inter_token_latency_seconds", LABELS),
    ("vllm:inter_token_latency_seconds", VLLM_LABELS),
    ("vllm:time_per_output_token_seconds", VLLM_LABELS),
)
TOKEN_NAMES = (("modelfleet_generation_tokens", LABELS), ("vllm:generation_tokens", VLLM_LABELS))
NAMES = tuple(name for name, _ in (*ITL_NAMES, *TOKEN_NAMES))


def outputs(seed: int) -> list[tuple[str, str, int, float | None]]:
    """(model, version, tokens, gap) as Generation adds them: gaps on and around the bucket bounds,
    several tokens in one output, first outputs with no gap, two versions."""
    rng = random.Random(seed)
    gaps = [*_LATENCY_BUCKETS, 0.0, 1e-9, 0.0049999, 0.0050001, 30.0, None]
    out = []
    for _ in range(2000):
        gap = rng.choice(gaps) if rng.random() < 0.5 else rng.expovariate(50)
        out.append(
            (rng.choice(["m", "other"]), rng.choice(["v1", "v2"]), rng.choice([1, 1, 1, 2, 3, 7]), gap)
        )
    return out


def reference_text(added: list[tuple[str, str, int, float | None]]) -> str:
    """The exposition of the metrics as they were: each token observed alone, under every name."""
    registry = CollectorRegistry()
    doc = "Time between consecutive generated tokens."
    hists = [
        Histogram(n, doc, labels, buckets=_LATENCY_BUCKETS, registry=registry) for n, labels in ITL_NAMES
    ]
    counters = [Counter(n, "Tokens generated.", labels, registry=registry) for n, labels in TOKEN_NAMES]
    for model, version, count, gap in added:
        if gap is not None:
            for _ in range(count):
                for hist in hists:
                    hist.labels(model, version).observe(gap)
        for counter in counters:
            counter.labels(model, version).inc(count)
    return generate_latest(registry).decode()


def lines_of(text: str, *, created: bool) -> list[str]:
    """The exposition lines of NAMES, sorted (the registries order families differently); `_created`
    lines (their timestamps) only with `created`."""
    kept = []
    for line in text.splitlines():
        # "# HELP name doc", "# TYPE name type" or "name{labels} value"
        name = line.split(" ")[2] if line.startswith("#") else line.split("{")[0]
        if name.startswith(NAMES) and name.endswith("_created") == created:
            kept.append(line)
    return sorted(kept)


def test_exposition_equals_prometheus_clients_per_token_observations():
    metrics = ServerMetrics()
    for model, version, count, gap in outputs(0):
        metrics.stream_counts(model, version).add(count, gap)
    ours, reference = metrics.render().decode(), reference_text(outputs(0))
    assert lines_of(ours, created=False) == lines_of(reference, created=False)
    assert any("_bucket{" in line and 'le="0.005"' in line for line in lines_of(ours, created=False))
    # the same _created series, one per version and name (only their timestamps differ)
    strip = [line.rsplit(" ", 1)[0] for line in lines_of(ours, created=True)]
    assert strip == [line.rsplit(" ", 1)[0] for line in lines_of(reference, created=True)]
    assert len(strip) == (4 + 2) * len(NAMES)  # four versions, and HELP and TYPE


def test_before_any_token_only_help_and_type():
    text = ServerMetrics().render().decode()
    assert lines_of(text, created=False) == lines_of(reference_text([]), created=False)
    assert "# TYPE modelfleet_inter_token_latency_seconds histogram" in text
    assert "vllm:generation_tokens_total{" not in text


def test_counts_add_up():
    counts = ServerMetrics().stream_counts("m", "v1")
    counts.add(1)
    counts.add(3, 0.03)
    assert counts.tokens == 4
    assert counts.buckets[_LATENCY_BUCKETS.index(0.04)] == 3 and sum(counts.buckets) == 3
    assert counts.gap_sum == 0.03 + 0.03 + 0.03


def test_a_versions_metrics_are_looked_up_once_and_exported():
    metrics = ServerMetrics()
    version = metrics.of_version("m", "v1")
    assert metrics.of_version("m", "v1") is version and metrics.of_version("m", "v2") is not version
    assert version.stream is metrics.stream_counts("m", "v1")
    version.ttft.observe(0.03)
    version.request_generation_tokens.observe(7)
    text = metrics.render().decode()
    assert 'modelfleet_time_to_first_token_seconds_count{model="m",version="v1"} 1.0' in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="m",version="v1"} 1.0' in text
    assert 'vllm:request_generation_tokens_sum{model_name="m",version="v1"} 7.0' in text
