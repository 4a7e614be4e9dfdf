"""The status of a ModelVersion, from the outcomes of its conversion Jobs.

Phase: Pending (no Job yet) -> Converting (Jobs exist, not all finished) -> Ready (every target has an
artifact) or Failed (a target cannot be converted; the Ready condition's reason says why). A Job whose pod
cannot be created stays Converting (the Job controller keeps retrying), with Ready's reason
QuotaExceeded or PodCreationFailed and the Job controller's message.
"""

from __future__ import annotations

from typing import Any

from modelfleet.converters.formats import Target
from modelfleet.operator.reconcile.conditions import condition, merge_conditions
from modelfleet.operator.reconcile.conversion import JobOutcome
from modelfleet.operator.reconcile.names import target_slug
from modelfleet.operator.reconcile.targets import TargetError


def version_status(
    *,
    generation: int | None,
    targets: list[Target] | TargetError,
    outcomes: dict[str, JobOutcome],
    old_status: dict[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """`outcomes` maps a target slug to its Job's outcome; returns the whole new status."""
    old_status = old_status or {}
    artifacts: list[dict[str, Any]] = []
    if isinstance(targets, TargetError):
        # ModelNotFound may resolve itself when the model is created; the others need a new version.
        phase = "Pending" if targets.reason == "ModelNotFound" else "Failed"
        ready = condition("Ready", False, targets.reason, str(targets), generation)
    else:
        phase, ready, artifacts = _from_outcomes(targets, outcomes, generation)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase,
        "artifacts": artifacts,
        "conditions": merge_conditions(old_status.get("conditions"), [ready], now),
    }
    # Conditions the version status does not compute (e.g. the finalizer's InUse) are kept as they are.
    kept = [c for c in old_status.get("conditions", []) if c.get("type") != "Ready"]
    status["conditions"] += kept
    return status


def _from_outcomes(
    targets: list[Target], outcomes: dict[str, JobOutcome], generation: int | None
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    artifacts, failures, waiting = [], [], []
    for target in targets:
        slug = target_slug(target)
        outcome = outcomes.get(slug, JobOutcome("missing"))
        if outcome.state in ("succeeded", "failed") and outcome.result is not None:
            if outcome.result.ok and outcome.result.artifact:
                artifacts.append(outcome.result.artifact)
            else:
                failures.append((slug, outcome.result.reason, outcome.result.message))
        else:
            waiting.append((slug, outcome))
    if failures:
        slug, reason, message = failures[0]
        more = f" ({len(failures) - 1} more target(s) failed)" if len(failures) > 1 else ""
        text = f"conversion to {slug} failed: {message or reason}{more}"
        return "Failed", condition("Ready", False, reason, text, generation), artifacts
    if not waiting:
        text = f"{len(artifacts)} artifact(s) ready: " + ", ".join(target_slug(t) for t in targets)
        return "Ready", condition("Ready", True, "ArtifactsReady", text, generation), artifacts
    blocked = [(slug, outcome) for slug, outcome in waiting if outcome.state == "blocked"]
    if blocked:
        slug, outcome = blocked[0]
        more = f" ({len(blocked) - 1} more target(s) blocked)" if len(blocked) > 1 else ""
        text = f"conversion Job for {slug} cannot create its pod: {outcome.message}{more}"
        reason = outcome.reason or "PodCreationFailed"
        return "Converting", condition("Ready", False, reason, text, generation), artifacts
    started = [slug for slug, outcome in waiting if outcome.state != "missing"]
    if not started:
        pending = ", ".join(slug for slug, _ in waiting)
        return (
            "Pending",
            condition("Ready", False, "Pending", f"conversion Jobs not created yet: {pending}", generation),
            artifacts,
        )
    text = f"converting {', '.join(slug for slug, _ in waiting)}; {len(artifacts)}/{len(targets)} done"
    return "Converting", condition("Ready", False, "Converting", text, generation), artifacts
