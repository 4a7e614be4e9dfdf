"""Reads the data-plane pods' /metrics for a rollout: the thin I/O edge of the canary.

The pods are those the model's Service selects. Each is scraped on its own address, not through the
Service's virtual IP: that would reach one pod at random per request, and a rollout needs the sum over
all of them. Pods that do not answer are left out of this sample (their counters stay in the previous
one, so the next window still counts them); when none answers the scrape fails as a whole.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from modelfleet.operator.kube import Kube
from modelfleet.operator.reconcile import names
from modelfleet.operator.reconcile.windows import Sample, VersionCounters
from prometheus_client.parser import text_string_to_metric_families

# The data plane's metric families (dataplane/server/metrics.py), labels model and version.
REQUESTS = "modelfleet_requests"  # counter, label status (the HTTP status code)
E2E_LATENCY = "modelfleet_e2e_request_latency_seconds"  # histogram
MAX_PARALLEL = 8


class ScrapeError(RuntimeError):
    """No data-plane pod's metrics could be read."""


def parse_metrics(text: str, model: str) -> dict[str, VersionCounters]:
    """The request and latency counters of `model`'s versions in one Prometheus text exposition."""
    versions: dict[str, VersionCounters] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (REQUESTS, E2E_LATENCY):
            continue
        for sample in family.samples:
            labels = sample.labels
            if labels.get("model") != model or not labels.get("version"):
                continue
            counters = versions.setdefault(labels["version"], VersionCounters())
            if sample.name == f"{REQUESTS}_total" and "status" in labels:
                counters.statuses[labels["status"]] = sample.value
            elif sample.name == f"{E2E_LATENCY}_bucket" and "le" in labels:
                counters.buckets[labels["le"]] = sample.value
    return versions


def pod_address(pod: dict[str, Any], default_port: int) -> str | None:
    """http://ip:port of a running pod's server (its container port named http), None if it has none."""
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    if not status.get("podIP"):
        return None
    port = default_port
    for container in pod.get("spec", {}).get("containers", []):
        for entry in container.get("ports", []) or []:
            if entry.get("name") == "http":
                port = int(entry["containerPort"])
    host = status["podIP"]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def scrape_pods(pods: list[dict[str, Any]], model: str, *, default_port: int, timeout: float = 5.0) -> Sample:
    """Scrape every running pod's /metrics in parallel; raises ScrapeError when none answers."""
    targets = {p["metadata"]["name"]: a for p in pods if (a := pod_address(p, default_port))}
    if not targets:
        raise ScrapeError(f"no running data-plane pod of {model} to scrape")
    failures: list[str] = []

    def one(item: tuple[str, str]) -> tuple[str, dict[str, VersionCounters] | None]:
        pod, address = item
        try:
            response = client.get(f"{address}/metrics")
            response.raise_for_status()
            return pod, parse_metrics(response.text, model)
        except (httpx.HTTPError, ValueError) as exc:
            failures.append(f"{pod}: {exc}")
            return pod, None

    with (
        httpx.Client(timeout=timeout, trust_env=False) as client,
        ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(targets))) as pool,
    ):
        results = list(pool.map(one, sorted(targets.items())))
    sample = {pod: versions for pod, versions in results if versions is not None}
    if not sample:
        raise ScrapeError(f"no data-plane pod of {model} answered /metrics ({'; '.join(failures)[:300]})")
    return sample


class MetricsSource:
    """Lists the pods behind a model's Service and scrapes them."""

    def __init__(self, kube: Kube, default_port: int, timeout: float = 5.0) -> None:
        self.kube, self.default_port, self.timeout = kube, default_port, timeout

    def __call__(self, namespace: str, model: str) -> Sample:
        pods = self.kube.list("v1", "Pod", namespace, names.selector_labels(model))
        return scrape_pods(pods, model, default_port=self.default_port, timeout=self.timeout)
