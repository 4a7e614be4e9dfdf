"""Prometheus metrics, prefix `modelfleet_`, labels `model` and `version`.

Each server owns its registry (tests run several servers in one process). Engine gauges (running,
waiting, KV-cache usage, prefix-cache hit ratio) are read from the loaded engines at scrape time.

Waiting counts every request of the pod that has not started: in the server's admission queue and in
the engine's own queue. `modelfleet_num_requests_waiting` has it per version, `POD_WAITING_METRIC` for
the whole pod (always exported, 0 when idle or nothing is loaded): the autoscaler's signal.

The same numbers are exported under vLLM's names too (`vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`...), labelled `model_name` (vLLM's label)
and `version`: the Gateway API Inference Extension's endpoint picker, KEDA recipes and vLLM dashboards
read those without any mapping.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from modelfleet.dataplane.engine.protocol import Engine
from modelfleet.dataplane.server.model_manager import VersionSlot
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

LABELS = ("model", "version")
VLLM_LABELS = ("model_name", "version")
LOAD_STATES = ("unloaded", "loading", "loaded", "failed")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_LOAD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

POD_WAITING_METRIC = "modelfleet_pod_requests_waiting"

Engines = Callable[[], Iterable[tuple[str, str, Engine]]]
AdmissionWaiting = Callable[[], dict[tuple[str, str], int]]


class _EngineCollector(Collector):
    """Gauges and counters sampled from each loaded engine's `stats()` when Prometheus scrapes."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.admission_waiting: AdmissionWaiting = dict

    def collect(self) -> Iterator[Metric]:
        specs = {
            "num_requests_running": "Requests the engine is running (prefill or decode).",
            "num_requests_waiting": "Requests not started: in the server's admission queue or the engine's.",
            "kv_cache_usage_ratio": "Fraction of KV-cache blocks in use (0..1).",
            "prefix_cache_hit_ratio": "Fraction of prompt tokens served from the prefix cache.",
            "kv_cache_free_blocks": "KV-cache blocks free.",
            "spec_decode_acceptance_ratio": "Share of speculative draft tokens accepted (0: off).",
            "spec_decode_mean_accepted_length": "Tokens a sequence gains per speculative verify step.",
        }
        families = {
            name: GaugeMetricFamily(f"modelfleet_{name}", doc, labels=LABELS) for name, doc in specs.items()
        }
        counters = {
            name: CounterMetricFamily(f"modelfleet_{name}", doc, labels=LABELS) for name, doc in _COUNTERS
        }
        vllm = {
            name: (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=VLLM_LABELS
            )
            for name, kind, doc, _ in _VLLM_ENGINE
        }
        admitting = self.admission_waiting()
        reported: set[tuple[str, str]] = set()
        for model, version, engine in self.engines():
            try:
                stats = engine.stats()
            except Exception:  # a scrape must never fail because one engine is shutting down
                continue
            reported.add((model, version))
            values = {
                "num_requests_running": stats.num_running,
                "num_requests_waiting": stats.num_waiting + admitting.get((model, version), 0),
                "kv_cache_usage_ratio": stats.kv_cache_usage,
                "prefix_cache_hit_ratio": stats.prefix_cache_hit_rate,
                "kv_cache_free_blocks": stats.num_free_blocks,
                "spec_decode_acceptance_ratio": getattr(stats, "spec_acceptance_rate", 0.0),
                "spec_decode_mean_accepted_length": getattr(stats, "spec_mean_accepted_length", 0.0),
            }
            for name, value in values.items():
                families[name].add_metric([model, version], float(value))
            for name, _ in _COUNTERS:
                counters[name].add_metric([model, version], float(getattr(stats, name, 0)))
            for name, _, _, source in _VLLM_ENGINE:
                value = values[source] if source in values else getattr(stats, source, 0)
                vllm[name].add_metric([model, version], float(value))
        for (model, version), waiting in admitting.items():
            if (model, version) not in reported and waiting:  # an engine replaced or unloaded meanwhile
                families["num_requests_waiting"].add_metric([model, version], float(waiting))
                vllm["vllm:num_requests_waiting"].add_metric([model, version], float(waiting))
        total = sum(sample.value for sample in families["num_requests_waiting"].samples)
        pod = GaugeMetricFamily(
            POD_WAITING_METRIC,
            "Requests of this pod not started yet (admission queues and engine queues, all versions).",
        )
        pod.add_metric([], float(total))
        yield from families.values()
        yield from counters.values()
        yield pod
        yield from vllm.values()


# Counters of EngineStats fields, since the engine started: the host KV tier's.
_COUNTERS = (
    ("host_kv_hits", "Prompt tokens whose KV blocks were copied back from the host KV tier."),
    ("host_kv_spills", "KV blocks evicted from the device's prefix cache and copied to the host KV tier."),
)


# vLLM's engine metrics: name, kind, help, and where the value comes from (one of the values above, else
# an EngineStats field). The counters count since the engine started: they sum across pods, and a
# reload is a counter reset, which rate() handles.
_VLLM_ENGINE = (
    ("vllm:num_requests_running", "gauge", "Requests running (prefill or decode).", "num_requests_running"),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting to start.", "num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage (1 means 100 percent).", "kv_cache_usage_ratio"),
    (
        "vllm:prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    ("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("vllm:num_preemptions", "counter", "Requests preempted by the scheduler.", "num_preemptions"),
    ("vllm:spec_decode_num_drafts", "counter", "Verify steps of a sequence with drafts.", "spec_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.", "spec_num_draft_tokens"),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "counter",
        "Draft tokens accepted.",
        "spec_num_accepted_tokens",
    ),
)


class StreamCounts:
    """One version's generated tokens and the gaps between them. Every streamed token lands here, so
    it is counted without prometheus_client's per-sample lock and bucket search for each token and
    each of the three histogram names: one call per engine output, on the event loop (the only
    writer; a scrape reads the numbers as they are, as prometheus_client's own would)."""

    __slots__ = ("buckets", "created", "gap_sum", "tokens")

    def __init__(self) -> None:
        self.buckets = [0] * (len(_LATENCY_BUCKETS) + 1)  # per bucket, not cumulative; the last is +Inf
        self.gap_sum = 0.0
        self.tokens = 0
        self.created = time.time()

    def add(self, count: int, gap: float | None = None) -> None:
        """`count` tokens generated; with `gap`, each of them came `gap` seconds after the one before."""
        self.tokens += count
        if gap is not None:
            # bisect_left: the first bound >= gap, the bucket a Histogram counts it in (le is inclusive)
            self.buckets[bisect_left(_LATENCY_BUCKETS, gap)] += count
            for _ in range(count):  # as `count` observations sum: the same float, bit for bit
                self.gap_sum += gap


class _StreamCollector(Collector):
    """StreamCounts of every version, as the families prometheus_client's Histogram and Counter would
    export for them: the same names, help, labels, buckets and samples."""

    _ITL_HELP = "Time between consecutive generated tokens."
    # (name, labels): ours, vLLM's, and vLLM's older name for it, still read by many dashboards
    _ITL = (
        ("modelfleet_inter_token_latency_seconds", LABELS),
        ("vllm:inter_token_latency_seconds", VLLM_LABELS),
        ("vllm:time_per_output_token_seconds", VLLM_LABELS),
    )
    _TOKENS = (("modelfleet_generation_tokens", LABELS), ("vllm:generation_tokens", VLLM_LABELS))
    _BOUNDS = [*(floatToGoString(b) for b in _LATENCY_BUCKETS), "+Inf"]

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], StreamCounts] = {}

    def counts(self, model: str, version: str) -> StreamCounts:
        counts = self._counts.get((model, version))
        if counts is None:
            counts = self._counts[(model, version)] = StreamCounts()
        return counts

    def collect(self) -> Iterator[Metric]:
        versions = list(self._counts.items())
        for name, label_names in self._ITL:
            family = Metric(name, self._ITL_HELP, "histogram")
            for values, counts in versions:
                labels = dict(zip(label_names, values, strict=True))
                total = 0
                for bound, count in zip(self._BOUNDS, counts.buckets, strict=True):
                    total += count
                    family.add_sample(f"{name}_bucket", {**labels, "le": bound}, float(total))
                family.add_sample(f"{name}_count", labels, float(total))
                family.add_sample(f"{name}_sum", labels, counts.gap_sum)
                family.add_sample(f"{name}_created", labels, counts.created)
            yield family
        for name, label_names in self._TOKENS:
            family = Metric(name, "Tokens generated.", "counter")
            for values, counts in versions:
                labels = dict(zip(label_names, values, strict=True))
                family.add_sample(f"{name}_total", labels, float(counts.tokens))
                family.add_sample(f"{name}_created", labels, counts.created)
            yield family


_Metric = TypeVar("_Metric", Counter, Histogram)


class _Both(Generic[_Metric]):
    """One of our metrics, then its vLLM twins, updated together (the callers see one metric)."""

    def __init__(self, *metrics: _Metric) -> None:
        self.metrics: tuple[_Metric, ...] = metrics

    def labels(self, model: str, version: str) -> _BothChild[_Metric]:
        return _BothChild(tuple(metric.labels(model, version) for metric in self.metrics))


class _BothChild(Generic[_Metric]):
    def __init__(self, children: tuple[_Metric, ...]) -> None:
        self.children: tuple[_Metric, ...] = children

    def observe(self: _BothChild[Histogram], value: float) -> None:
        for child in self.children:
            child.observe(value)

    def inc(self: _BothChild[Counter], value: float = 1) -> None:
        for child in self.children:
            child.inc(value)


@dataclass(frozen=True)
class VersionMetrics:
    """One version's children of the metrics every request updates."""

    ttft: _BothChild[Histogram]
    e2e: _BothChild[Histogram]
    prompt_tokens: _BothChild[Counter]
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    stream: StreamCounts


class ServerMetrics:
    def __init__(self, engines: Engines = lambda: ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelfleet_requests", "Requests answered, by HTTP status.", [*LABELS, "status"], registry=r
        )

        def latency(name: str, doc: str, buckets: tuple[float, ...], *vllm_names: str) -> _Both[Histogram]:
            ours = Histogram(f"modelfleet_{name}", doc, LABELS, buckets=buckets, registry=r)
            theirs = [Histogram(n, doc, VLLM_LABELS, buckets=buckets, registry=r) for n in vllm_names]
            return _Both(ours, *theirs)

        self.ttft = latency(
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            _LATENCY_BUCKETS,
            "vllm:time_to_first_token_seconds",
        )
        # Inter-token latency and generated tokens: counted once per engine output, exported as the
        # histograms and counters of these names (stream_counts).
        self._streams = _StreamCollector()
        r.register(self._streams)
        self._versions: dict[tuple[str, str], VersionMetrics] = {}
        self.e2e = latency(
            "e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            _E2E_BUCKETS,
            "vllm:e2e_request_latency_seconds",
        )
        self.prompt_tokens = _Both(
            Counter("modelfleet_prompt_tokens", "Prompt tokens processed.", LABELS, registry=r),
            Counter("vllm:prompt_tokens", "Prompt tokens processed.", VLLM_LABELS, registry=r),
        )
        # Per request (all its prompts and choices), as vLLM's histograms of the same names.
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens of each request.",
            VLLM_LABELS,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens of each request.",
            VLLM_LABELS,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.load_seconds = Histogram(
            "modelfleet_model_load_seconds",
            "Time to load a version.",
            LABELS,
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.load_state = Gauge(
            "modelfleet_model_load_state",
            "1 for the version's current load state (unloaded, loading, loaded, failed), else 0.",
            [*LABELS, "state"],
            registry=r,
        )
        self.load_failures = Counter(
            "modelfleet_model_load_failures", "Failed loads of a version.", LABELS, registry=r
        )
        self.shadow_requests = Counter(
            "modelfleet_shadow_requests",
            "Mirrored requests, answers discarded; status ok or error.",
            [*LABELS, "status"],
            registry=r,
        )
        self.shadow_e2e = Histogram(
            "modelfleet_shadow_e2e_request_latency_seconds",
            "End-to-end latency of mirrored requests.",
            LABELS,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_waiting = Gauge(
            "modelfleet_admission_queue_waiting", "Requests waiting for admission to the engines.", registry=r
        )
        self.rejected = Counter(
            "modelfleet_rejected_requests", "Requests refused by limits, by reason.", ["reason"], registry=r
        )
        self.client_timeouts = Counter(
            "modelfleet_client_timeouts",
            "Connections cut because the client was too slow: reason header, body or send (stopped reading).",
            ["reason"],
            registry=r,
        )
        self.manifest_reloads = Counter(
            "modelfleet_manifest_reloads",
            "Manifest reloads, by result (applied or invalid).",
            ["result"],
            registry=r,
        )
        self._engines = _EngineCollector(engines)
        r.register(self._engines)

    def stream_counts(self, model: str, version: str) -> StreamCounts:
        """The version's generated tokens and inter-token gaps, to add each engine output to."""
        return self._streams.counts(model, version)

    def of_version(self, model: str, version: str) -> VersionMetrics:
        """The version's per-request metrics, looked up once (each `labels()` takes a lock and hashes)."""
        found = self._versions.get((model, version))
        if found is None:
            found = self._versions[(model, version)] = VersionMetrics(
                ttft=self.ttft.labels(model, version),
                e2e=self.e2e.labels(model, version),
                prompt_tokens=self.prompt_tokens.labels(model, version),
                request_prompt_tokens=self.request_prompt_tokens.labels(model, version),
                request_generation_tokens=self.request_generation_tokens.labels(model, version),
                stream=self.stream_counts(model, version),
            )
        return found

    def count_admission(self, waiting: AdmissionWaiting) -> None:
        """Where the server's admission queues are, so that waiting counts the requests there too."""
        self._engines.admission_waiting = waiting

    def set_load_state(self, model: str, version: str, state: str) -> None:
        for candidate in LOAD_STATES:
            self.load_state.labels(model, version, candidate).set(1.0 if candidate == state else 0.0)

    def on_load_state(self, slot: VersionSlot) -> None:
        """Model-manager hook: a version's load state changed."""
        model, version = slot.spec.model, slot.spec.version
        self.set_load_state(model, version, slot.state.value)
        if slot.state.value == "failed":
            self.load_failures.labels(model, version).inc()

    def on_loaded(self, slot: VersionSlot, seconds: float) -> None:
        self.load_seconds.labels(slot.spec.model, slot.spec.version).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
