"""InferenceModel status: conditions and reasons from the planned traffic and the Deployment."""

from __future__ import annotations

from modelfleet.operator.reconcile.model_status import model_status
from modelfleet.operator.reconcile.traffic import PlannedVersion

NOW = "2026-01-01T00:00:00Z"
ENDPOINT = "http://chat.team-a.svc:8000/v1"


def planned(name, desired, weight, reason="Servable", phase="Ready", message="serving torch bf16"):
    path = f"/models/{name}" if reason == "Servable" else None
    return PlannedVersion(name, desired, weight, phase, path, reason, message)


def deployment(ready=1, replicas=1, generation=1, observed=1, updated=None, conditions=()):
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "observedGeneration": observed,
            "conditions": list(conditions),
        },
    }


def status(plan, deploy, old=None):
    return model_status(generation=4, planned=plan, deploy=deploy, endpoint=ENDPOINT, old_status=old, now=NOW)


def conditions(st) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_serving_everything():
    st = status([planned("v1", 90, 90), planned("v2", 10, 10)], deployment(ready=2, replicas=2))
    assert conditions(st) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("False", "Stable"),
        "Degraded": ("False", "AsExpected"),
    }
    assert st["traffic"] == "v1=90,v2=10" and st["endpoint"] == ENDPOINT
    assert st["observedGeneration"] == 4 and st["readyReplicas"] == 2
    assert st["versions"][1] == {
        "name": "v2",
        "phase": "Ready",
        "weight": 10,
        "readyReplicas": 2,
        "message": "serving torch bf16",
    }
    assert all(c["observedGeneration"] == 4 and c["lastTransitionTime"] == NOW for c in st["conditions"])


def test_canary_still_converting_is_degraded_and_progressing():
    plan = [
        planned("v1", 90, 100),
        planned("v2", 10, 0, "VersionNotReady", "Converting", "version is Converting"),
    ]
    st = status(plan, deployment())
    assert conditions(st) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("True", "Converting"),
        "Degraded": ("True", "VersionNotReady"),
    }
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert "10% of the requested traffic" in degraded["message"] and "v2" in degraded["message"]
    assert st["traffic"] == "v1=100,v2=0"


def test_nothing_servable_names_the_reason():
    plan = [planned("v1", 100, 0, "NoArtifactForHardware", "Ready", "no artifact for nvidia-l4")]
    st = status(plan, deployment(ready=1))
    assert conditions(st)["Ready"] == ("False", "NoArtifactForHardware")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "no version can take traffic: v1: no artifact for nvidia-l4"


def test_missing_version_outranks_not_ready():
    plan = [
        planned("v1", 50, 0, "VersionNotReady", "Converting", "converting"),
        planned("v9", 50, 0, "VersionNotFound", None, "no ModelVersion 'v9'"),
    ]
    assert conditions(status(plan, None))["Ready"] == ("False", "VersionNotFound")


def test_quota_blocking_pods_is_reported():
    refused = {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreate",
        "message": 'pods "chat-abc" is forbidden: exceeded quota: gpus, requested: nvidia.com/gpu=1',
    }
    st = status([planned("v1", 100, 100)], deployment(ready=0, conditions=[refused]))
    assert conditions(st)["Ready"] == ("False", "QuotaExceeded")
    assert conditions(st)["Degraded"] == ("True", "QuotaExceeded")
    assert "exceeded quota" in next(c for c in st["conditions"] if c["type"] == "Ready")["message"]


def test_pods_not_ready_and_rolling_out():
    st = status([planned("v1", 100, 100)], deployment(ready=0, replicas=2, updated=1))
    assert conditions(st)["Ready"] == ("False", "PodsNotReady")
    assert conditions(st)["Progressing"] == ("True", "RollingOut")


def test_unchanged_status_keeps_transition_times():
    first = status([planned("v1", 100, 100)], deployment())
    later = model_status(
        generation=4,
        planned=[planned("v1", 100, 100)],
        deploy=deployment(),
        endpoint=ENDPOINT,
        old_status=first,
        now="2026-02-02T00:00:00Z",
    )
    assert later == first
