"""Prometheus metrics, prefix `modelfleet_`, labels `model` and `version`.

Each server owns its registry (tests run several servers in one process). Engine gauges (running,
waiting, KV-cache usage, prefix-cache hit ratio) are read from the loaded engines at scrape time.

Waiting counts every request of the pod that has not started: in the server's admission queue and in
the engine's own queue. `modelfleet_num_requests_waiting` has it per version, `POD_WAITING_METRIC` for
the whole pod (always exported, 0 when idle or nothing is loaded): the autoscaler's signal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ("model", "version")
LOAD_STATES = ("unloaded", "loading", "loaded", "failed")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_LOAD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

POD_WAITING_METRIC = "modelfleet_pod_requests_waiting"

Engines = Callable[[], Iterable[tuple[str, str, Any]]]
AdmissionWaiting = Callable[[], dict[tuple[str, str], int]]


class _EngineCollector(Collector):
    """Gauges sampled from each loaded engine's `stats()` when Prometheus scrapes."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.admission_waiting: AdmissionWaiting = dict

    def collect(self):
        specs = {
            "num_requests_running": "Requests the engine is running (prefill or decode).",
            "num_requests_waiting": "Requests not started: in the server's admission queue or the engine's.",
            "kv_cache_usage_ratio": "Fraction of KV-cache blocks in use (0..1).",
            "prefix_cache_hit_ratio": "Fraction of prompt tokens served from the prefix cache.",
            "kv_cache_free_blocks": "KV-cache blocks free.",
        }
        families = {
            name: GaugeMetricFamily(f"modelfleet_{name}", doc, labels=LABELS) for name, doc in specs.items()
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
            }
            for name, value in values.items():
                families[name].add_metric([model, version], float(value))
        for (model, version), waiting in admitting.items():
            if (model, version) not in reported and waiting:  # an engine replaced or unloaded meanwhile
                families["num_requests_waiting"].add_metric([model, version], float(waiting))
        total = sum(sample.value for sample in families["num_requests_waiting"].samples)
        pod = GaugeMetricFamily(
            POD_WAITING_METRIC,
            "Requests of this pod not started yet (admission queues and engine queues, all versions).",
        )
        pod.add_metric([], float(total))
        yield from families.values()
        yield pod


class ServerMetrics:
    def __init__(self, engines: Engines = lambda: ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelfleet_requests", "Requests answered, by HTTP status.", [*LABELS, "status"], registry=r
        )
        self.ttft = Histogram(
            "modelfleet_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "modelfleet_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "modelfleet_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            LABELS,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "modelfleet_prompt_tokens", "Prompt tokens processed.", LABELS, registry=r
        )
        self.generation_tokens = Counter(
            "modelfleet_generation_tokens", "Tokens generated.", LABELS, registry=r
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

    def count_admission(self, waiting: AdmissionWaiting) -> None:
        """Where the server's admission queues are, so that waiting counts the requests there too."""
        self._engines.admission_waiting = waiting

    def set_load_state(self, model: str, version: str, state: str) -> None:
        for candidate in LOAD_STATES:
            self.load_state.labels(model, version, candidate).set(1.0 if candidate == state else 0.0)

    def on_load_state(self, slot: Any) -> None:
        """Model-manager hook: a version's load state changed."""
        model, version = slot.spec.model, slot.spec.version
        self.set_load_state(model, version, slot.state.value)
        if slot.state.value == "failed":
            self.load_failures.labels(model, version).inc()

    def on_loaded(self, slot: Any, seconds: float) -> None:
        self.load_seconds.labels(slot.spec.model, slot.spec.version).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
