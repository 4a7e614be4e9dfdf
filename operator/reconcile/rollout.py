"""The automated canary of `spec.rollout`, as a pure decision: state + observed windows -> next state.

The state lives in `status.rollout` (phase, step index, when the step began, the baseline split, the
counters the step's window started from), so a decision depends only on what is stored and observed:
running it twice on the same state gives the same answer.

A rollout starts from `spec.traffic`. The candidate takes `steps[0]` percent; every other version of
`spec.traffic` shares the rest in proportion to its weight there (the *baseline*). A step is judged once
`interval` has passed since it began *and* the candidate has answered at least `minRequests` requests
in the step's window; with fewer the step waits (it never moves on blindly). A judged step either
breaches a threshold (5xx error rate above `maxErrorRate`, p95 end-to-end latency above
`maxP95LatencyMs`), which rolls back (candidate 0, the baseline split restored), or passes: the
candidate moves to the next step, and after the last step it takes 100 percent (Succeeded).

Changing the candidate, the steps or `spec.traffic` starts the rollout over (`specHash`); interval,
minRequests and thresholds apply to the running one.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from modelfleet.operator.api import InferenceModelSpec, Rollout
from modelfleet.operator.reconcile.serving import duration_seconds
from modelfleet.operator.reconcile.traffic import redistribute
from modelfleet.operator.reconcile.windows import VersionWindow

FINISHED = ("Succeeded", "RolledBack")
Stage = Literal["start", "wait", "judge", "finished"]
Action = Literal["start", "wait", "pause", "advance", "succeed", "rollback", "finished"]
EVENT_REASONS = {
    "start": ("Normal", "RolloutStepAdvanced"),
    "advance": ("Normal", "RolloutStepAdvanced"),
    "succeed": ("Normal", "RolloutSucceeded"),
    "rollback": ("Warning", "RolloutRolledBack"),
    "pause": ("Warning", "RolloutPaused"),
}


@dataclass(frozen=True)
class Observed:
    """One scrape of the data-plane pods: the counters as stored, and the window since the step's start.

    `error` is set (and the rest empty) when no pod answered.
    """

    sample: dict[str, Any] = field(default_factory=dict)
    windows: dict[str, VersionWindow] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Decision:
    action: Action
    state: dict[str, Any] | None  # the new status.rollout (None: nothing to store)
    message: str = ""

    @property
    def event(self) -> tuple[str, str, str] | None:
        """(type, reason, message) of the Event to post, when the decision changes something."""
        if self.action not in EVENT_REASONS:
            return None
        return (*EVENT_REASONS[self.action], self.message)

    @property
    def traffic(self) -> list[dict[str, Any]]:
        return list((self.state or {}).get("traffic", []))


def spec_hash(spec: InferenceModelSpec) -> str:
    """What defines a rollout: a change of any of it starts a new one."""
    assert spec.rollout is not None
    key = {
        "candidate": spec.rollout.candidate,
        "steps": spec.rollout.steps,
        "traffic": [[t.version, t.weight] for t in spec.traffic],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def baseline_split(spec: InferenceModelSpec, total: int = 100) -> dict[str, int]:
    """The versions other than the candidate, scaled to `total` in their spec.traffic proportions."""
    assert spec.rollout is not None
    others = {t.version: t.weight for t in spec.traffic if t.version != spec.rollout.candidate}
    return redistribute(others, total)


def split_with(spec: InferenceModelSpec, candidate_weight: int) -> list[dict[str, Any]]:
    """spec.traffic's versions, in order, with the candidate at `candidate_weight` and the baseline
    sharing the rest in proportion (scaled from spec.traffic's weights, so rounding happens once)."""
    assert spec.rollout is not None
    rest = baseline_split(spec, 100 - candidate_weight)
    return [
        {
            "version": t.version,
            "weight": candidate_weight if t.version == spec.rollout.candidate else rest.get(t.version, 0),
        }
        for t in spec.traffic
    ]


def is_current(spec: InferenceModelSpec, state: dict[str, Any] | None) -> bool:
    """Whether `state` belongs to the rollout `spec` asks for (else it is one from before)."""
    return bool(spec.rollout and state and state.get("specHash") == spec_hash(spec))


def effective_traffic(spec: InferenceModelSpec, state: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The split to serve instead of spec.traffic while (and after) a rollout runs; None: spec.traffic."""
    if not is_current(spec, state) or not (state or {}).get("traffic"):
        return None
    return list(state["traffic"])  # type: ignore[index]


def stage(spec: InferenceModelSpec, state: dict[str, Any] | None, now: dt.datetime) -> Stage:
    """What the rollout needs now: start, wait for the step's interval, judge the step, or nothing."""
    if spec.rollout is None:
        return "finished"
    if not is_current(spec, state):
        return "start"
    assert state is not None
    if state.get("phase") in FINISHED:
        return "finished"
    started = _parse_time(state.get("stepStartedAt"))
    if started is not None and (now - started).total_seconds() < duration_seconds(spec.rollout.interval):
        return "wait"
    return "judge"


def decide(
    spec: InferenceModelSpec, state: dict[str, Any] | None, now: dt.datetime, observed: Observed | None
) -> Decision:
    """The rollout's next state. `observed` is needed to start or judge a step (see `stage`)."""
    what = stage(spec, state, now)
    if what in ("finished", "wait"):
        return Decision(what, state)
    rollout = spec.rollout
    assert rollout is not None
    if observed is None:
        observed = Observed(error="the data-plane pods were not scraped")
    if what == "start":
        return _start(spec, rollout, now, observed)
    assert state is not None
    if observed.error is not None:
        weight = rollout.steps[state["step"]]
        text = f"no metrics ({observed.error}); holding step {_step(state['step'], rollout)} at {weight}%"
        return Decision("pause", {**state, "phase": "Paused", "message": text[:1024]}, text)
    return _judge(spec, rollout, state, now, observed)


def _start(spec: InferenceModelSpec, rollout: Rollout, now: dt.datetime, observed: Observed) -> Decision:
    baseline = baseline_split(spec)
    state = {
        "candidate": rollout.candidate,
        "phase": "Progressing",
        "step": 0,
        "stepStartedAt": _format_time(now),
        "specHash": spec_hash(spec),
        "baseline": [{"version": v, "weight": w} for v, w in baseline.items()],
        "traffic": split_with(spec, rollout.steps[0]),
        "lastMetrics": [],
        "message": "",
        "sample": observed.sample or None,  # None: read none (a merge patch removes the old one)
    }
    if sum(baseline.values()) == 0:
        text = f"spec.traffic already sends all requests to {rollout.candidate}; nothing to roll out"
        return Decision("succeed", {**state, "phase": "Succeeded", "traffic": split_with(spec, 100)}, text)
    text = f"step {_step(0, rollout)}: {_describe_split(state['traffic'])}; {_judged_when(rollout)}"
    if observed.error is not None:
        text += f" (no metrics yet: {observed.error})"
    return Decision("start", {**state, "message": text[:1024]}, text)


def _judge(
    spec: InferenceModelSpec, rollout: Rollout, state: dict[str, Any], now: dt.datetime, observed: Observed
) -> Decision:
    candidate = observed.windows.get(rollout.candidate, VersionWindow(rollout.candidate))
    metrics = [observed.windows.get(t.version, VersionWindow(t.version)).as_status() for t in spec.traffic]
    step = state["step"]
    judged = {**state, "phase": "Progressing", "lastMetrics": metrics}

    if not state.get("sample"):
        # No counters were read when the step began: its window can only start now.
        text = f"step {_step(step, rollout)}: metrics are readable again; the step's window starts now"
        new = {**judged, "stepStartedAt": _format_time(now), "sample": observed.sample, "message": text}
        return Decision("wait", new, text)
    if candidate.requests < rollout.min_requests:
        # Keep the window's starting counters: the window grows until it holds enough requests.
        text = (
            f"step {_step(step, rollout)}: {rollout.candidate} answered {candidate.requests} request(s) "
            f"since {state['stepStartedAt']}, fewer than minRequests {rollout.min_requests}; "
            "waiting for more before judging"
        )
        return Decision("wait", {**judged, "message": text[:1024]}, text)

    if rollout.thresholds.max_p95_latency_ms is not None and candidate.p95_seconds is None:
        text = (
            f"step {_step(step, rollout)}: {rollout.candidate} has no latency observations to compare with "
            "maxP95LatencyMs (no request reached generation); waiting for some before judging"
        )
        return Decision("wait", {**judged, "message": text[:1024]}, text)
    breaches = _breaches(candidate, rollout)
    if breaches:
        restored = split_with(spec, 0)
        text = (
            f"{rollout.candidate} breached {'; '.join(breaches)} at step {_step(step, rollout)}; "
            f"rolled back to {_describe_split(restored)}"
        )
        new = {**judged, "phase": "RolledBack", "traffic": restored, "message": text[:1024]}
        return Decision("rollback", new, text)

    passed = f"step {_step(step, rollout)} passed ({_health(candidate, rollout)})"
    fresh = {**judged, "stepStartedAt": _format_time(now), "sample": observed.sample}
    if step + 1 >= len(rollout.steps):
        final = split_with(spec, 100)
        text = f"{passed}; {rollout.candidate} takes all traffic: {_describe_split(final)}"
        return Decision("succeed", {**fresh, "phase": "Succeeded", "traffic": final, "message": text}, text)
    following = split_with(spec, rollout.steps[step + 1])
    text = f"{passed}; step {_step(step + 1, rollout)}: {_describe_split(following)}"
    new = {**fresh, "step": step + 1, "traffic": following, "message": text[:1024]}
    return Decision("advance", new, text)


def _breaches(window: VersionWindow, rollout: Rollout) -> list[str]:
    breaches = []
    limits = rollout.thresholds
    if window.error_rate is not None and window.error_rate > limits.max_error_rate:
        breaches.append(
            f"maxErrorRate: error rate {window.error_rate:.2%} ({window.errors} of {window.requests} "
            f"requests failed) > {limits.max_error_rate:.2%}"
        )
    if (
        limits.max_p95_latency_ms is not None
        and window.p95_seconds is not None
        and window.p95_seconds * 1000 > limits.max_p95_latency_ms
    ):
        p95_ms = window.p95_seconds * 1000
        breaches.append(f"maxP95LatencyMs: p95 latency {p95_ms:.0f} ms > {limits.max_p95_latency_ms} ms")
    return breaches


def _health(window: VersionWindow, rollout: Rollout) -> str:
    limits = rollout.thresholds
    parts = [
        f"{window.requests} requests",
        f"error rate {window.error_rate or 0:.2%} <= {limits.max_error_rate:.2%}",
    ]
    if window.p95_seconds is not None:
        bound = f" <= {limits.max_p95_latency_ms} ms" if limits.max_p95_latency_ms is not None else ""
        parts.append(f"p95 {window.p95_seconds * 1000:.0f} ms{bound}")
    return ", ".join(parts)


def _step(index: int, rollout: Rollout) -> str:
    return f"{index + 1}/{len(rollout.steps)}"


def _judged_when(rollout: Rollout) -> str:
    return f"judged after {rollout.interval} once {rollout.candidate} has {rollout.min_requests} requests"


def _describe_split(traffic: list[dict[str, Any]]) -> str:
    return ",".join(f"{t['version']}={t['weight']}" for t in traffic)


def _format_time(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str | None) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None
