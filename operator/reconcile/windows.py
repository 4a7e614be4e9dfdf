"""Per-version request windows from two scrapes of the data-plane pods' counters (pure).

A sample is what every pod's /metrics said at one moment: per pod, per version, the request counter by
HTTP status and the cumulative end-to-end latency buckets. A window is the difference of two samples,
summed over pods. Counters only grow, so a counter smaller than before means its pod restarted: the
pod's whole current count is then the window's (the same rule as Prometheus' `increase`). A pod that
appears in the later sample only counts from zero.

Errors are 5xx answers (the server failed); 4xx are the client's and 499 means the client left, so they
count as requests but not as errors. The p95 is read from the merged bucket deltas by linear
interpolation inside the bucket that holds the 95th percentile (as Prometheus' `histogram_quantile`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

QUANTILE = 0.95


@dataclass
class VersionCounters:
    """One pod's counters of one version: requests by status code, cumulative latency buckets by `le`."""

    statuses: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, float] = field(default_factory=dict)


Sample = dict[str, dict[str, VersionCounters]]  # pod name -> version -> counters


@dataclass(frozen=True)
class VersionWindow:
    version: str
    statuses: dict[str, int] = field(default_factory=dict)
    p95_seconds: float | None = None

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def errors(self) -> int:
        return sum(n for code, n in self.statuses.items() if code.startswith("5"))

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    def as_status(self) -> dict[str, Any]:
        """The window as status.rollout.lastMetrics[] (camelCase; unknown values left out)."""
        entry: dict[str, Any] = {"version": self.version, "requests": self.requests, "errors": self.errors}
        if self.error_rate is not None:
            entry["errorRate"] = round(self.error_rate, 6)
        if self.p95_seconds is not None:
            entry["p95LatencyMs"] = round(self.p95_seconds * 1000, 1)
        return entry


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    if any(after.get(key, 0.0) < value for key, value in before.items()):
        return dict(after)  # the counter went back: the pod restarted
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _le(bound: str) -> float:
    return math.inf if bound in ("+Inf", "Inf", "inf") else float(bound)


def quantile(q: float, buckets: dict[str, float]) -> float | None:
    """The q-quantile of cumulative buckets {le: count}; None without observations.

    Falling in the +Inf bucket gives the highest finite bound: the histogram knows nothing above it.
    """
    ordered = sorted(((_le(le), count) for le, count in buckets.items()), key=lambda b: b[0])
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def windows(previous: Sample, current: Sample) -> dict[str, VersionWindow]:
    """What each version did between two samples, summed over the pods of the later one."""
    statuses: dict[str, dict[str, float]] = {}
    buckets: dict[str, dict[str, float]] = {}
    for pod, versions in current.items():
        for version, now in versions.items():
            before = previous.get(pod, {}).get(version, VersionCounters())
            for key, value in _delta(before.statuses, now.statuses).items():
                statuses.setdefault(version, {})[key] = statuses.get(version, {}).get(key, 0.0) + value
            for key, value in _delta(before.buckets, now.buckets).items():
                buckets.setdefault(version, {})[key] = buckets.get(version, {}).get(key, 0.0) + value
    return {
        version: VersionWindow(
            version=version,
            statuses={code: round(n) for code, n in statuses.get(version, {}).items() if round(n) > 0},
            p95_seconds=quantile(QUANTILE, buckets.get(version, {})),
        )
        for version in sorted(set(statuses) | set(buckets))
    }


# --- the sample as stored in status.rollout.sample (lists, so a JSON merge patch replaces them whole) --


def sample_to_status(sample: Sample, taken_at: str) -> dict[str, Any]:
    return {
        "takenAt": taken_at,
        "pods": [
            {
                "name": pod,
                "versions": [
                    {
                        "version": version,
                        "statuses": [{"code": c, "count": n} for c, n in sorted(counters.statuses.items())],
                        "buckets": [
                            {"le": le, "count": n}
                            for le, n in sorted(counters.buckets.items(), key=lambda b: _le(b[0]))
                        ],
                    }
                    for version, counters in sorted(versions.items())
                ],
            }
            for pod, versions in sorted(sample.items())
        ],
    }


def sample_from_status(stored: dict[str, Any] | None) -> Sample:
    sample: Sample = {}
    for pod in (stored or {}).get("pods", []) or []:
        versions = sample.setdefault(str(pod.get("name")), {})
        for entry in pod.get("versions", []) or []:
            versions[str(entry.get("version"))] = VersionCounters(
                statuses={str(s["code"]): float(s["count"]) for s in entry.get("statuses", []) or []},
                buckets={str(b["le"]): float(b["count"]) for b in entry.get("buckets", []) or []},
            )
    return sample
