"""The kopf handlers against kmock, an emulated Kubernetes API: objects in, requests and objects out.

The handlers are called as kopf calls them (keyword arguments, sync handlers in a worker thread), with
the operator's real `Kube` client pointed at the emulator.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
from typing import Any

import aiohttp.web
import kmock
import kopf
import pytest
import yaml
from kubernetes import client
from modelfleet.operator import handlers, sync
from modelfleet.operator.kube import Kube
from modelfleet.operator.reconcile import names
from modelfleet.operator.settings import OperatorSettings
from test_metrics_source import MetricsServer

NS = "team-a"
IM = "modelfleet.dev/v1alpha1/inferencemodels"
MV = "modelfleet.dev/v1alpha1/modelversions"
JOBS, PODS, DEPLOYMENTS = "batch/v1/jobs", "v1/pods", "apps/v1/deployments"
RESOURCES = {
    IM: "InferenceModel",
    MV: "ModelVersion",
    JOBS: "Job",
    PODS: "Pod",
    DEPLOYMENTS: "Deployment",
    "v1/configmaps": "ConfigMap",
    "v1/services": "Service",
    "autoscaling/v2/horizontalpodautoscalers": "HorizontalPodAutoscaler",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
}
log = logging.getLogger("test")


class ApplyingEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the two server-side-apply behaviours we rely on: apply creates what is
    missing, and applying what is already there changes nothing (no write, no watch event)."""

    async def _handle(self, request: Any) -> Any:
        is_apply = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        if is_apply and request.resource is not None and request.name and request.data:
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                self.objects[key] = request.data
            elif _contains(json.loads(json.dumps(self.objects[key].raw)), request.data):
                return aiohttp.web.json_response(self.objects[key].raw)
        return await super()._handle(request)


def _contains(whole: Any, part: Any) -> bool:
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and _contains(whole[k], v) for k, v in part.items())
    return whole == part


pytestmark = pytest.mark.kmock(cls=ApplyingEmulator)


@pytest.fixture()
def api(kmock):
    for resource, kind in RESOURCES.items():
        kmock.resources[resource] = {"kind": kind, "namespaced": True}
    config = client.Configuration()
    config.host = str(kmock.url).rstrip("/")
    return Kube(client.ApiClient(config))


@pytest.fixture()
def events() -> list[tuple[str, str, str, str]]:
    """Kubernetes Events the operator posted: (object name, type, reason, message)."""
    return []


@pytest.fixture()
def memo(api, events):
    memo = kopf.Memo()
    settings = OperatorSettings(dataplane_image="registry.example/modelfleet:1.2.3")

    def record(obj, type_, reason, message):
        events.append((obj["metadata"]["name"], type_, reason, message))

    memo.ctx = sync.Context(kube=api, settings=settings, clock=lambda: "2026-01-01T00:00:00Z", record=record)
    return memo


@pytest.fixture()
def cluster(kmock, example_objects):
    """examples/model.yaml, stored in the emulated API server."""
    for obj in example_objects.values():
        resource = IM if obj["kind"] == "InferenceModel" else MV
        kmock.objects[resource, NS, obj["metadata"]["name"]] = obj
    return example_objects


async def call(handler, obj: dict, memo, **kwargs):
    """Run a handler the way kopf runs a sync one: in a worker thread, with keyword arguments."""
    return await asyncio.to_thread(handler, body=copy.deepcopy(obj), memo=memo, logger=log, **kwargs)


async def fetch(kmock, path: str) -> dict | None:
    response = await kmock.get(path)
    return await response.json() if response.status == 200 else None


async def obj(kmock, resource: str, name: str) -> dict | None:
    group_version, plural = resource.rsplit("/", 1)
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return await fetch(kmock, f"{base}/namespaces/{NS}/{plural}/{name}")


def requests(kmock, method: str, pattern: str) -> list:
    return [r for r in list(kmock) if r.method.value == method and re.search(pattern, str(r.url))]


async def finish_job(kmock, name: str, summary: dict) -> dict:
    """What the Job controller and the kubelet would leave behind: a Complete Job and its finished pod."""
    ok = summary.get("ok", False)
    job = await obj(kmock, JOBS, name)
    job["status"] = {
        "conditions": [
            {
                "type": "Complete" if ok else "Failed",
                "status": "True",
                "reason": "Done" if ok else "BackoffLimitExceeded",
                "message": "",
            }
        ]
    }
    kmock.objects[JOBS, NS, name] = job
    kmock.objects[PODS, NS, f"{name}-abcde"] = finished_pod(name, summary)
    return job


def finished_pod(job: str, summary: dict) -> dict:
    """A pod of `job` whose converter container terminated with `summary` as its message."""
    ok = summary.get("ok", False)
    terminated = {
        "exitCode": 0 if ok else 1,
        "finishedAt": "2026-01-01T00:10:00Z",
        "message": json.dumps(summary),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-abcde", "namespace": NS, "labels": {"job-name": job}},
        "status": {
            "phase": "Succeeded" if ok else "Failed",
            "containerStatuses": [{"name": "convert", "state": {"terminated": terminated}}],
        },
    }


def artifact(version: str, dtype: str) -> dict:
    slug = f"nvidia-h100-torch-{dtype}"
    return {
        "ok": True,
        "accelerator": "nvidia-h100",
        "format": "torch",
        "dtype": dtype,
        "uri": f"pvc://modelfleet-models/artifacts/chat/{version}/{slug}",
        "sha256": "0" * 64,
        "sizeBytes": 10,
        "validation": {"top1Agreement": 1.0},
    }


def condition(status: dict, type_: str) -> tuple[str, str]:
    cond = next(c for c in status["conditions"] if c["type"] == type_)
    return cond["status"], cond["reason"]


async def test_new_model_gets_conversion_jobs_and_serving_objects(kmock, cluster, memo, events):
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")

    for name in (
        "chat-v1-convert-nvidia-h100-torch-bf16",
        "chat-v2-convert-nvidia-h100-torch-bf16",
        "chat-v2-convert-nvidia-h100-torch-fp8",
    ):
        job = await obj(kmock, JOBS, name)
        assert job is not None, name
        assert job["metadata"]["ownerReferences"][0]["kind"] == "ModelVersion"
    assert await obj(kmock, "v1/configmaps", "chat-manifest") is not None
    assert (await obj(kmock, DEPLOYMENTS, "chat"))["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example/modelfleet:1.2.3"
    )
    assert await obj(kmock, "v1/services", "chat") is not None
    assert (await obj(kmock, "v1/services", "chat-peers"))["spec"]["clusterIP"] == "None"
    assert await obj(kmock, "autoscaling/v2/horizontalpodautoscalers", "chat") is not None
    # Every write is a server-side apply under one field manager.
    applies = requests(kmock, "PATCH", r"fieldManager=modelfleet-operator")
    assert len(applies) == 3 + 6 and all("apply-patch" in r.headers["Content-Type"] for r in applies)

    v2 = (await obj(kmock, MV, "chat-v2"))["status"]
    assert v2["phase"] == "Converting" and condition(v2, "Ready") == ("False", "Converting")
    im = (await obj(kmock, IM, "chat"))["status"]
    assert im["traffic"] == "v1=0,v2=0"
    assert condition(im, "Ready") == ("False", "VersionNotReady")
    assert im["endpoint"] == "http://chat.team-a.svc:8000/v1"
    started = [(name, reason) for name, _, reason, _ in events if reason == "ConversionStarted"]
    assert started == [
        ("chat-v1", "ConversionStarted"),
        ("chat-v2", "ConversionStarted"),
        ("chat-v2", "ConversionStarted"),
    ]
    assert ("chat-v2", "Normal", "Converting") in [e[:3] for e in events]


async def test_finished_conversion_moves_traffic_and_traffic_edits_keep_the_pods(
    kmock, cluster, memo, events
):
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    job = await finish_job(kmock, "chat-v1-convert-nvidia-h100-torch-bf16", artifact("v1", "bf16"))
    await call(handlers.job_event, job, memo)

    v1 = (await obj(kmock, MV, "chat-v1"))["status"]
    assert v1["phase"] == "Ready" and v1["artifacts"][0]["uri"].endswith("v1/nvidia-h100-torch-bf16")
    manifest = (await obj(kmock, "v1/configmaps", "chat-manifest"))["data"]["manifest.yaml"]
    assert "weight: 100" in manifest and "/models/artifacts/chat/v1/nvidia-h100-torch-bf16" in manifest
    im = (await obj(kmock, IM, "chat"))["status"]
    assert im["traffic"] == "v1=100,v2=0" and condition(im, "Degraded") == ("True", "VersionNotReady")
    assert (
        "chat",
        "Normal",
        "TrafficUpdated",
        "serving traffic v1=100,v2=0 (requested: v1=90,v2=10)",
    ) in events

    for dtype in ("bf16", "fp8"):
        job = await finish_job(kmock, f"chat-v2-convert-nvidia-h100-torch-{dtype}", artifact("v2", dtype))
    await call(handlers.job_event, job, memo)
    assert (await obj(kmock, IM, "chat"))["status"]["traffic"] == "v1=90,v2=10"
    template = (await obj(kmock, DEPLOYMENTS, "chat"))["spec"]["template"]

    edited = await obj(kmock, IM, "chat")
    edited["spec"]["traffic"] = [{"version": "v1", "weight": 20}, {"version": "v2", "weight": 80}]
    edited["metadata"]["generation"] = 2
    kmock.objects[IM, NS, "chat"] = edited
    await call(handlers.model_changed, edited, memo, reason="update")
    assert (await obj(kmock, DEPLOYMENTS, "chat"))["spec"]["template"] == template
    manifest = (await obj(kmock, "v1/configmaps", "chat-manifest"))["data"]["manifest.yaml"]
    assert "weight: 80" in manifest
    status = (await obj(kmock, IM, "chat"))["status"]
    assert status["traffic"] == "v1=20,v2=80" and status["observedGeneration"] == 2


async def test_reconciling_again_writes_nothing(kmock, cluster, memo):
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    before = len(requests(kmock, "PATCH", r"/status$"))
    assert before == 3  # the model and its two versions
    model = await obj(kmock, IM, "chat")
    seen = len(list(kmock))
    await call(handlers.model_resync, model, memo)
    assert len(requests(kmock, "PATCH", r"/status$")) == before
    assert len(requests(kmock, "PATCH", r"/jobs/")) == 3  # Jobs are created once, never re-applied
    # Nothing changed, so nothing is written: no apply, no delete, no status, no Event; only reads: the
    # model, its versions, their Jobs, the Events of the three Jobs that have no pod yet, the six
    # serving objects.
    idle = [f"{r.method.value} {r.url.path}" for r in list(kmock)[seen:]]
    assert [r for r in idle if not r.startswith("GET ")] == []
    assert len(idle) == 1 + 1 + 2 + 3 + 6, idle


async def test_a_deleted_child_comes_back(kmock, cluster, memo):
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    deployment = await obj(kmock, DEPLOYMENTS, "chat")
    await kmock.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/chat")
    assert await obj(kmock, DEPLOYMENTS, "chat") is None
    await call(handlers.serving_child_event, deployment, memo)
    assert (await obj(kmock, DEPLOYMENTS, "chat"))["spec"] == deployment["spec"]


async def test_a_version_in_traffic_is_kept_until_traffic_leaves_it(kmock, cluster, memo):
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    v2 = await obj(kmock, MV, "chat-v2")
    with pytest.raises(kopf.TemporaryError, match=r"still in spec\.traffic of InferenceModel chat"):
        await call(handlers.version_deleted, v2, memo)
    assert condition((await obj(kmock, MV, "chat-v2"))["status"], "InUse") == ("True", "TrafficStillRouted")

    model = await obj(kmock, IM, "chat")
    model["spec"]["traffic"] = [{"version": "v1", "weight": 100}]
    kmock.objects[IM, NS, "chat"] = model
    await call(handlers.version_deleted, await obj(kmock, MV, "chat-v2"), memo)  # returns: kopf lets it go


async def test_traffic_to_a_missing_version_is_a_condition_not_a_crash(kmock, cluster, memo):
    model = copy.deepcopy(cluster["chat"])
    model["spec"]["traffic"] = [{"version": "v1", "weight": 50}, {"version": "v7", "weight": 50}]
    kmock.objects[IM, NS, "chat"] = model
    await call(handlers.model_changed, model, memo, reason="create")
    status = (await obj(kmock, IM, "chat"))["status"]
    assert condition(status, "Ready") == ("False", "VersionNotFound")
    assert "'v7'" in next(c for c in status["conditions"] if c["type"] == "Ready")["message"]


async def test_a_spec_the_operator_cannot_use_is_permanent_and_reported(kmock, cluster, memo):
    model = copy.deepcopy(cluster["chat"])
    model["spec"]["traffic"][0]["weight"] = 80  # sums to 90: only an old CRD would let this through
    kmock.objects[IM, NS, "chat"] = model
    with pytest.raises(kopf.PermanentError, match=r"spec\.traffic"):
        await call(handlers.model_changed, model, memo, reason="create")
    status = (await obj(kmock, IM, "chat"))["status"]
    assert condition(status, "Ready") == ("False", "InvalidSpec")
    assert await obj(kmock, DEPLOYMENTS, "chat") is None


@pytest.mark.parametrize(
    ("code", "error", "words"),
    [
        (503, kopf.TemporaryError, "Kubernetes API"),
        (403, kopf.TemporaryError, "check its RBAC"),
        (422, kopf.PermanentError, "rejected"),
    ],
)
async def test_api_failures_map_to_kopf_errors(kmock, cluster, memo, code, error, words):
    kmock[re.compile(r".*/modelversions$")] << code << {"kind": "Status", "message": f"boom {code}"}
    with pytest.raises(error, match=words) as caught:
        await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    assert f"boom {code}" in str(caught.value)


async def test_a_deleted_version_leaves_the_served_traffic(kmock, cluster, memo):
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    await finish_job(kmock, "chat-v1-convert-nvidia-h100-torch-bf16", artifact("v1", "bf16"))
    for dtype in ("bf16", "fp8"):
        await finish_job(kmock, f"chat-v2-convert-nvidia-h100-torch-{dtype}", artifact("v2", dtype))
    await call(handlers.model_resync, await obj(kmock, IM, "chat"), memo)
    assert (await obj(kmock, IM, "chat"))["status"]["traffic"] == "v1=90,v2=10"

    v2 = await obj(kmock, MV, "chat-v2")
    await kmock.delete(f"/apis/modelfleet.dev/v1alpha1/namespaces/{NS}/modelversions/chat-v2")
    await call(handlers.version_event, v2, memo, type="DELETED")
    status = (await obj(kmock, IM, "chat"))["status"]
    assert status["traffic"] == "v1=100,v2=0" and condition(status, "Degraded") == ("True", "VersionNotFound")
    assert await obj(kmock, MV, "chat-v2") is None  # and nothing wrote to the deleted version


async def test_a_version_deleted_mid_reconcile_is_skipped(kmock, cluster, memo):
    kmock[re.compile(r".*/modelversions/chat-v2/status$")] << 404 << {"kind": "Status", "message": "gone"}
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")  # no error
    assert (await obj(kmock, IM, "chat"))["status"]["traffic"] == "v1=0,v2=0"


async def test_a_second_version_of_the_same_name_converts_nothing_and_says_so(kmock, cluster, memo):
    copycat = copy.deepcopy(cluster["chat-v1"])
    copycat["metadata"].update(name="chat-v1-again", uid="u-again", creationTimestamp="2030-01-01T00:00:00Z")
    cluster["chat-v1"]["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    kmock.objects[MV, NS, "chat-v1"] = cluster["chat-v1"]
    kmock.objects[MV, NS, "chat-v1-again"] = copycat
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    status = (await obj(kmock, MV, "chat-v1-again"))["status"]
    assert status["phase"] == "Failed" and condition(status, "Ready") == ("False", "DuplicateVersion")
    assert "ModelVersion chat-v1 already provides chat@v1" in status["conditions"][0]["message"]
    assert await obj(kmock, JOBS, "chat-v1-again-convert-nvidia-h100-torch-bf16") is None
    assert (await obj(kmock, MV, "chat-v1"))["status"]["phase"] == "Converting"


async def test_a_version_quantizing_lm_head_says_so_to_its_quantized_conversion(kmock, cluster, memo):
    v2 = copy.deepcopy(cluster["chat-v2"])
    v2["spec"]["quantizeLmHead"] = True
    kmock.objects[MV, NS, "chat-v2"] = v2
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    commands = {}
    for dtype in ("bf16", "fp8"):
        job = await obj(kmock, JOBS, f"chat-v2-convert-nvidia-h100-torch-{dtype}")
        commands[dtype] = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--quantize-lm-head" in commands["fp8"] and "--quantize-lm-head" not in commands["bf16"]
    out = commands["fp8"][commands["fp8"].index("--out") + 1]
    assert out.endswith("/artifacts/chat/v2/nvidia-h100-torch-fp8-lm-head")
    assert (await obj(kmock, MV, "chat-v2"))["status"]["phase"] == "Converting"


async def test_quantize_lm_head_without_quantization_is_an_invalid_spec(kmock, cluster, memo):
    v1 = copy.deepcopy(cluster["chat-v1"])
    v1["spec"]["quantizeLmHead"] = True  # quantization none: only an old CRD would let this through
    kmock.objects[MV, NS, "chat-v1"] = v1
    await call(handlers.model_changed, cluster["chat"], memo, reason="create")
    status = (await obj(kmock, MV, "chat-v1"))["status"]
    assert status["phase"] == "Failed" and condition(status, "Ready") == ("False", "InvalidSpec")
    message = next(c for c in status["conditions"] if c["type"] == "Ready")["message"]
    assert "spec.quantizeLmHead: quantizeLmHead applies to quantization int8 or fp8, not none" in message
    assert await obj(kmock, JOBS, "chat-v1-convert-nvidia-h100-torch-bf16") is None


# --- rollouts --------------------------------------------------------------------------------------------


@pytest.fixture()
def metrics_server():
    server = MetricsServer()
    yield server
    server.close()


def data_plane_pod(name: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": names.selector_labels("chat")},
        "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


async def served_weights(kmock) -> dict[str, int]:
    manifest = yaml.safe_load((await obj(kmock, "v1/configmaps", "chat-manifest"))["data"]["manifest.yaml"])
    return {v["name"]: v["weight"] for v in manifest["models"][0]["versions"]}


async def rollout_cluster(kmock, cluster, memo, metrics_server, clock, **rollout_spec) -> dict:
    """chat with both versions converted, one data-plane pod serving /metrics, and spec.rollout set."""
    model = copy.deepcopy(cluster["chat"])
    model["spec"]["traffic"] = [{"version": "v1", "weight": 100}, {"version": "v2", "weight": 0}]
    model["spec"]["rollout"] = {"candidate": "v2", "interval": "1m", "minRequests": 10, **rollout_spec}
    kmock.objects[IM, NS, "chat"] = model
    memo.ctx.clock = lambda: clock[0]
    await call(handlers.model_changed, model, memo, reason="create")
    await finish_job(kmock, "chat-v1-convert-nvidia-h100-torch-bf16", artifact("v1", "bf16"))
    for dtype in ("bf16", "fp8"):
        await finish_job(kmock, f"chat-v2-convert-nvidia-h100-torch-{dtype}", artifact("v2", dtype))
    kmock.objects[PODS, NS, "chat-7d9f-abcde"] = data_plane_pod("chat-7d9f-abcde", metrics_server.port)
    await call(handlers.model_resync, await obj(kmock, IM, "chat"), memo)
    assert await served_weights(kmock) == {"v1": 100, "v2": 0}
    return model


def rollout_events(events) -> list[tuple[str, str]]:
    return [(type_, reason) for _, type_, reason, _ in events if reason.startswith("Rollout")]


async def test_the_rollout_timer_steps_the_canary_and_rolls_back_on_errors(
    kmock, cluster, memo, events, metrics_server
):
    clock = ["2026-01-01T10:00:00Z"]
    await rollout_cluster(kmock, cluster, memo, metrics_server, clock, steps=[50, 100])

    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    status = (await obj(kmock, IM, "chat"))["status"]
    assert status["rollout"]["phase"] == "Progressing" and status["rollout"]["step"] == 0
    assert status["rollout"]["sample"]["pods"][0]["name"] == "chat-7d9f-abcde"
    assert status["traffic"] == "v1=50,v2=50" and await served_weights(kmock) == {"v1": 50, "v2": 50}
    assert rollout_events(events) == [("Normal", "RolloutStepAdvanced")]

    # Safe to run twice: the same tick again, then one before the interval is over, change nothing.
    writes = len(requests(kmock, "PATCH", r"/status$"))
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    clock[0] = "2026-01-01T10:00:59Z"
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    assert len(requests(kmock, "PATCH", r"/status$")) == writes and len(rollout_events(events)) == 1

    # Judged after the interval, but with too few candidate requests: it waits and says so.
    metrics_server.serve("chat", "v2", ok=4)
    clock[0] = "2026-01-01T10:01:00Z"
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    rollout_status = (await obj(kmock, IM, "chat"))["status"]["rollout"]
    assert rollout_status["step"] == 0 and "fewer than minRequests 10" in rollout_status["message"]

    metrics_server.serve("chat", "v2", ok=8)  # 12 since the step began
    metrics_server.serve("chat", "v1", ok=20, failed=20)  # the baseline's errors are not the candidate's
    clock[0] = "2026-01-01T10:01:10Z"
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    status = (await obj(kmock, IM, "chat"))["status"]
    assert status["rollout"]["step"] == 1 and status["rollout"]["stepStartedAt"] == "2026-01-01T10:01:10Z"
    assert {m["version"]: m["requests"] for m in status["rollout"]["lastMetrics"]} == {"v1": 40, "v2": 12}
    assert await served_weights(kmock) == {"v1": 0, "v2": 100}

    metrics_server.serve("chat", "v2", ok=8, failed=2)  # 20% > the default 1%
    clock[0] = "2026-01-01T10:02:10Z"
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    status = (await obj(kmock, IM, "chat"))["status"]
    assert status["rollout"]["phase"] == "RolledBack" and status["traffic"] == "v1=100,v2=0"
    assert await served_weights(kmock) == {"v1": 100, "v2": 0}
    assert rollout_events(events) == [
        ("Normal", "RolloutStepAdvanced"),
        ("Normal", "RolloutStepAdvanced"),
        ("Warning", "RolloutRolledBack"),
    ]
    rolled_back = next(e[3] for e in events if e[2] == "RolloutRolledBack")
    assert "error rate 20.00% (2 of 10 requests failed) > 1.00% at step 2/2" in rolled_back
    model = await obj(kmock, IM, "chat")
    assert not handlers._rollout_pending(spec=model["spec"], status=model["status"])

    # The result stays served by every later reconcile, until the user edits spec.
    await call(handlers.model_resync, model, memo)
    assert (await obj(kmock, IM, "chat"))["status"]["rollout"]["phase"] == "RolledBack"
    assert await served_weights(kmock) == {"v1": 100, "v2": 0}


async def test_a_healthy_canary_succeeds_and_dropping_spec_rollout_serves_spec_traffic(
    kmock, cluster, memo, events, metrics_server
):
    clock = ["2026-01-01T10:00:00Z"]
    model = await rollout_cluster(kmock, cluster, memo, metrics_server, clock, steps=[100])
    assert handlers._rollout_pending(spec=model["spec"], status={})
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    assert await served_weights(kmock) == {"v1": 0, "v2": 100}

    metrics_server.serve("chat", "v2", ok=30)
    clock[0] = "2026-01-01T10:05:00Z"
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    status = (await obj(kmock, IM, "chat"))["status"]
    assert status["rollout"]["phase"] == "Succeeded" and status["traffic"] == "v1=0,v2=100"
    assert rollout_events(events)[-1] == ("Normal", "RolloutSucceeded")

    edited = await obj(kmock, IM, "chat")
    del edited["spec"]["rollout"]
    edited["metadata"]["generation"] = 2
    kmock.objects[IM, NS, "chat"] = edited
    await call(handlers.model_changed, edited, memo, reason="update")
    status = (await obj(kmock, IM, "chat"))["status"]
    assert "rollout" not in status and status["traffic"] == "v1=100,v2=0"


async def test_a_rollout_without_reachable_pods_pauses(kmock, cluster, memo, events, metrics_server):
    clock = ["2026-01-01T10:00:00Z"]
    await rollout_cluster(kmock, cluster, memo, metrics_server, clock)
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    metrics_server.close()
    clock[0] = "2026-01-01T10:01:00Z"
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    rollout_status = (await obj(kmock, IM, "chat"))["status"]["rollout"]
    assert rollout_status["phase"] == "Paused" and rollout_status["step"] == 0
    assert "no data-plane pod of chat answered /metrics" in rollout_status["message"]
    assert rollout_events(events)[-1] == ("Warning", "RolloutPaused")
    assert await served_weights(kmock) == {"v1": 90, "v2": 10}
    clock[0] = "2026-01-01T10:01:10Z"
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    assert [e for e in rollout_events(events) if e[1] == "RolloutPaused"] == [("Warning", "RolloutPaused")]


async def test_a_running_canary_is_reported_in_the_progressing_condition(
    kmock, cluster, memo, metrics_server
):
    clock = ["2026-01-01T10:00:00Z"]
    await rollout_cluster(kmock, cluster, memo, metrics_server, clock)
    deployment = await obj(kmock, DEPLOYMENTS, "chat")  # its pods are all up
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"observedGeneration": 1, "readyReplicas": 1, "updatedReplicas": 1}
    kmock.objects[DEPLOYMENTS, NS, "chat"] = deployment
    await call(handlers.rollout_tick, await obj(kmock, IM, "chat"), memo)
    status = (await obj(kmock, IM, "chat"))["status"]
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "CanaryProgressing")
    assert progressing["message"].startswith("rollout of v2: step 1/3: v1=90,v2=10")
