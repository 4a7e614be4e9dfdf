"""A conversion Job whose pod is refused (ResourceQuota, admission webhook): the Job controller says so
only in FailedCreate Events, and the handlers carry that into the ModelVersion's Ready condition."""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qs, urlsplit

import pytest
import test_handlers_kmock
from modelfleet.operator import handlers, sync
from test_handlers_kmock import IM, JOBS, MV, NS, ApplyingEmulator, artifact, call, finish_job, obj, requests

pytestmark = pytest.mark.kmock(cls=ApplyingEmulator)
# The handler tests' fixtures: kmock as the API server, the operator's context, the posted Events.
api, memo, events, cluster = (
    test_handlers_kmock.api,
    test_handlers_kmock.memo,
    test_handlers_kmock.events,
    test_handlers_kmock.cluster,
)
EVENTS = "v1/events"
JOB = "chat-v1-convert-nvidia-h100-torch-bf16"
QUOTA = (
    f'Error creating: pods "{JOB}-x7k2p" is forbidden: exceeded quota: no-pods, requested: pods=1, '
    "used: pods=0, limited: pods=0"
)


def failed_create(name: str, job: str, uid: str, message: str = QUOTA, at: str = "2026-01-01T00:01:00Z"):
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": NS},
        "involvedObject": {"apiVersion": "batch/v1", "kind": "Job", "name": job, "namespace": NS, "uid": uid},
        "reason": "FailedCreate",
        "type": "Warning",
        "message": message,
        "lastTimestamp": at,
    }


async def job_with_uid(kmock, name: str, uid: str, active: int = 0) -> dict:
    """The Job as the API server keeps it: with a uid, and the Job controller's count of its pods."""
    job = await obj(kmock, JOBS, name)
    job["metadata"]["uid"] = uid
    job["status"] = {"active": active} if active else {}
    kmock.objects[JOBS, NS, name] = job
    return job


def selectors(kmock) -> list[str]:
    """The field selectors of the operator's Event lists, in order."""
    listed = requests(kmock, "GET", r"/api/v1/namespaces/team-a/events")
    return [parse_qs(urlsplit(str(r.url)).query)["fieldSelector"][0] for r in listed]


def ready(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


async def test_a_refused_pod_shows_in_the_version_and_clears_when_the_pod_exists(
    kmock, cluster, memo, events
):
    kmock.resources[EVENTS] = {"kind": "Event", "namespaced": True}
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    # Creating the Jobs lists no Events: a Job made a moment ago cannot have been refused yet.
    assert requests(kmock, "GET", r"/events") == []

    job = await job_with_uid(kmock, JOB, "uid-now")
    kmock.objects[EVENTS, NS, "e1"] = failed_create("e1", JOB, "uid-now")
    # The same name's earlier Job (deleted, re-created): its refusal is history.
    kmock.objects[EVENTS, NS, "e0"] = failed_create("e0", JOB, "uid-before", "old", "2026-01-01T00:09:00Z")
    await call(handlers.job_event, job, memo)

    mv = (await obj(kmock, MV, "chat-v1"))["status"]
    assert mv["phase"] == "Converting"
    assert (ready(mv)["status"], ready(mv)["reason"]) == ("False", "QuotaExceeded")
    assert ready(mv)["message"] == f"conversion Job for nvidia-h100-torch-bf16 cannot create its pod: {QUOTA}"
    assert ("chat-v1", "Warning", "QuotaExceeded", ready(mv)["message"]) in events
    # The model lists the version's message, so `kubectl get im chat -o yaml` shows it too.
    versions = (await obj(kmock, IM, "chat"))["status"]["versions"]
    assert "exceeded quota" in next(v for v in versions if v["name"] == "v1")["message"]
    # Asked of the server by field selector, the Job's uid included.
    assert f"involvedObject.kind=Job,involvedObject.name={JOB},involvedObject.uid=uid-now" in selectors(kmock)

    # Again, unchanged: no second Warning.
    await call(handlers.job_event, job, memo)
    assert [e[2] for e in events].count("QuotaExceeded") == 1

    # The quota is lifted; the Job controller creates the pod (active 1): no Events read, back to Converting.
    before = len([s for s in selectors(kmock) if JOB in s])
    job = await job_with_uid(kmock, JOB, "uid-now", active=1)
    await call(handlers.job_event, job, memo)
    assert len([s for s in selectors(kmock) if JOB in s]) == before
    assert ready((await obj(kmock, MV, "chat-v1"))["status"])["reason"] == "Converting"


async def test_an_idle_fleet_lists_no_events(kmock, cluster, memo):
    kmock.resources[EVENTS] = {"kind": "Event", "namespaced": True}
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    await finish_job(kmock, JOB, artifact("v1", "bf16"))
    for dtype in ("bf16", "fp8"):
        await finish_job(kmock, f"chat-v2-convert-nvidia-h100-torch-{dtype}", artifact("v2", dtype))
    await call(handlers.model_resync, await obj(kmock, IM, "chat"), memo)
    assert (await obj(kmock, IM, "chat"))["status"]["traffic"] == "v1=90,v2=10"
    assert requests(kmock, "GET", r"/events") == []


async def test_without_rbac_for_events_the_conversion_still_reconciles(
    kmock, cluster, memo, caplog, monkeypatch
):
    monkeypatch.setattr(sync, "_events_forbidden_said", False)
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    kmock[re.compile(r".*/events\b.*")] << 403 << {"kind": "Status", "message": "events is forbidden"}
    await call(handlers.job_event, await job_with_uid(kmock, JOB, "uid-now"), memo)
    assert ready((await obj(kmock, MV, "chat-v1"))["status"])["reason"] == "Converting"
    said = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == sync.__name__
    ]
    assert len(said) == 1 and "grant the operator `list` on events" in said[0]
