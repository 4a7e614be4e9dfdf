"""The status of an InferenceModel, from its planned traffic and its observed Deployment.

Conditions:
- Ready: pods are ready and some version takes traffic (reasons: Serving, VersionNotReady,
  NoArtifactForHardware, VersionNotFound, QuotaExceeded, PodsNotReady, InvalidSpec).
- Progressing: versions are converting, pods are rolling out or a canary runs (Converting, RollingOut,
  CanaryProgressing, CanaryPaused, Stable).
- Degraded: part of the requested traffic cannot be served, or quota blocks pods (reason of the first
  problem, or AsExpected).
"""

from __future__ import annotations

from typing import Any

from modelfleet.operator.reconcile.conditions import condition, merge_conditions
from modelfleet.operator.reconcile.traffic import PlannedVersion, traffic_summary

UNSERVABLE_ORDER = ("VersionNotFound", "NoArtifactForHardware", "ArtifactNotLocal", "VersionNotReady")


def quota_problem(deploy: dict[str, Any] | None) -> str | None:
    """The message of a ResourceQuota refusing the Deployment's pods, if any.

    The ReplicaSet controller reports a refused pod creation on the Deployment as a ReplicaFailure
    condition whose message quotes the API server's 'exceeded quota' error.
    """
    for cond in (deploy or {}).get("status", {}).get("conditions", []) or []:
        message = cond.get("message", "")
        if (
            cond.get("type") == "ReplicaFailure"
            and cond.get("status") == "True"
            and "exceeded quota" in message
        ):
            return message
    return None


def _rollout(deploy: dict[str, Any] | None) -> tuple[int, int, bool]:
    """(ready replicas, desired replicas, rolled out) of the observed Deployment."""
    if not deploy:
        return 0, 0, False
    status = deploy.get("status", {})
    desired = deploy.get("spec", {}).get("replicas", 1)
    ready = status.get("readyReplicas", 0) or 0
    updated = status.get("updatedReplicas", 0) or 0
    current = status.get("observedGeneration", 0) >= deploy.get("metadata", {}).get("generation", 0)
    return ready, desired, current and updated >= desired and ready >= desired


def model_status(
    *,
    generation: int | None,
    planned: list[PlannedVersion],
    deploy: dict[str, Any] | None,
    endpoint: str,
    old_status: dict[str, Any] | None,
    now: str,
    rollout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`rollout`: status.rollout of the rollout spec.rollout asks for (None when there is none)."""
    ready_replicas, desired_replicas, rolled_out = _rollout(deploy)
    serving = [p for p in planned if p.weight > 0]
    unservable = [p for p in planned if p.reason != "Servable" and p.desired_weight > 0]
    quota = quota_problem(deploy)
    converting = [p for p in planned if p.phase in ("Pending", "Converting")]

    if not serving:
        first = _first_problem(unservable) or (planned[0] if planned else None)
        reason = first.reason if first and first.reason != "Servable" else "VersionNotReady"
        message = f"no version can take traffic: {_describe(first)}" if first else "traffic lists no version"
        ready = condition("Ready", False, reason, message, generation)
    elif quota and ready_replicas == 0:
        ready = condition("Ready", False, "QuotaExceeded", quota, generation)
    elif ready_replicas == 0:
        ready = condition(
            "Ready", False, "PodsNotReady", f"0/{desired_replicas} data-plane pods ready", generation
        )
    else:
        split = traffic_summary(planned)
        ready = condition(
            "Ready", True, "Serving", f"{ready_replicas} pod(s) ready, serving {split}", generation
        )

    if converting:
        names_ = ", ".join(p.name for p in converting)
        progressing = condition("Progressing", True, "Converting", f"converting {names_}", generation)
    elif deploy is not None and not rolled_out:
        text = f"{ready_replicas}/{desired_replicas} data-plane pods ready"
        progressing = condition("Progressing", True, "RollingOut", text, generation)
    elif rollout and rollout.get("phase") in ("Progressing", "Paused"):
        reason = "CanaryProgressing" if rollout["phase"] == "Progressing" else "CanaryPaused"
        text = f"rollout of {rollout.get('candidate')}: {rollout.get('message') or 'starting'}"
        progressing = condition("Progressing", True, reason, text[:32768], generation)
    else:
        progressing = condition("Progressing", False, "Stable", "nothing in progress", generation)

    if quota:
        degraded = condition("Degraded", True, "QuotaExceeded", quota, generation)
    elif unservable:
        first = _first_problem(unservable)
        assert first is not None
        moved = sum(p.desired_weight for p in unservable)
        text = f"{moved}% of the requested traffic is redistributed: {_describe(first)}"
        if len(unservable) > 1:
            text += f" (and {len(unservable) - 1} more version(s))"
        degraded = condition("Degraded", True, first.reason, text, generation)
    else:
        degraded = condition(
            "Degraded", False, "AsExpected", "every version in traffic is served", generation
        )

    old_status = old_status or {}
    return {
        "observedGeneration": generation,
        "endpoint": endpoint,
        "traffic": traffic_summary(planned),
        "readyReplicas": ready_replicas,
        "versions": [
            {
                "name": p.name,
                **({"phase": p.phase} if p.phase else {}),
                "weight": p.weight,
                "readyReplicas": ready_replicas if p.artifact_path else 0,
                "message": p.message[:1024],
            }
            for p in planned
        ],
        "conditions": merge_conditions(old_status.get("conditions"), [ready, progressing, degraded], now),
    }


def invalid_spec_status(
    *, generation: int | None, message: str, old_status: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """Status of a model whose spec the operator cannot use (the API server let it through)."""
    old_status = old_status or {}
    conditions = [
        condition("Ready", False, "InvalidSpec", message, generation),
        condition("Degraded", True, "InvalidSpec", message, generation),
    ]
    return {
        **old_status,
        "observedGeneration": generation,
        "conditions": merge_conditions(old_status.get("conditions"), conditions, now),
    }


def _first_problem(unservable: list[PlannedVersion]) -> PlannedVersion | None:
    ranked = sorted(
        unservable, key=lambda p: UNSERVABLE_ORDER.index(p.reason) if p.reason in UNSERVABLE_ORDER else 9
    )
    return ranked[0] if ranked else None


def _describe(p: PlannedVersion | None) -> str:
    return f"{p.name}: {p.message}" if p else ""
