"""The whole kopf operator, with our handlers, against kmock: watch streams in, API calls out.

Where test_handlers_kmock.py calls the handlers directly, this runs `kopf.operator` itself so that the
handler registrations (resources, label filters, startup settings, the finalizer) are exercised too.
"""

from __future__ import annotations

import asyncio

import kopf
import modelfleet.operator.handlers  # noqa: F401  (registers the handlers)
import pytest
import yaml
from kubernetes.config import kube_config
from test_handlers_kmock import IM, MV, NS, RESOURCES, ApplyingEmulator, artifact, finished_pod, obj

pytestmark = pytest.mark.kmock(cls=ApplyingEmulator)
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


@pytest.fixture()
def emulated_cluster(kmock, tmp_path, monkeypatch, example_objects):
    for resource, kind in {**RESOURCES, "v1/events": "Event"}.items():
        kmock.resources[resource] = {
            "kind": kind,
            "namespaced": True,
            "verbs": VERBS,
            "subresources": {"status"},
        }
    # kopf watches these two to notice new resource kinds and namespaces.
    for resource, kind in {
        "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
        "v1/namespaces": "Namespace",
    }.items():
        kmock.resources[resource] = {"kind": kind, "namespaced": False, "verbs": VERBS}
    for doc in example_objects.values():
        doc["metadata"]["resourceVersion"] = "1"  # kopf guards its finalizer patch with it
        kmock.objects[IM if doc["kind"] == "InferenceModel" else MV, NS, doc["metadata"]["name"]] = doc
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
        "current-context": "kmock",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    # Both kopf's login and the operator's own client read the default kubeconfig location.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kmock


async def eventually(probe, timeout_s: float = 15.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if value := await probe():
            return value
        await asyncio.sleep(0.2)
    return await probe()


async def test_kopf_runs_the_handlers_on_watch_events(emulated_cluster):
    kmock = emulated_cluster
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(standalone=True, clusterwide=True, stop_flag=stop))
    try:
        # Created: Jobs, serving objects and status, from the watch streams alone.
        jobs = [f"chat-v2-convert-nvidia-h100-torch-{d}" for d in ("bf16", "fp8")]
        assert await eventually(lambda: _every(kmock, "batch/v1/jobs", jobs)), "no conversion Jobs"
        assert await eventually(lambda: obj(kmock, "apps/v1/deployments", "chat")), "no Deployment"
        assert await eventually(lambda: _traffic(kmock, "v1=0,v2=0"))

        async def protected():
            mv = await obj(kmock, MV, "chat-v1")
            return "modelfleet.dev/in-use-protection" in mv["metadata"].get("finalizers", []) or None

        assert await eventually(protected), "kopf put no finalizer (of our name) on the version"

        # A Job completes (an update on its watch stream): the version's artifact reaches the traffic.
        job = "chat-v1-convert-nvidia-h100-torch-bf16"
        kmock.objects["v1/pods", NS, f"{job}-abcde"] = finished_pod(job, artifact("v1", "bf16"))
        done = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
        await kmock.patch(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}", json=done)
        assert await eventually(lambda: _traffic(kmock, "v1=100,v2=0")), (
            "the finished Job did not move traffic"
        )

        # The traffic is edited: only the ConfigMap changes.
        template = (await obj(kmock, "apps/v1/deployments", "chat"))["spec"]["template"]
        split = {
            "spec": {"traffic": [{"version": "v1", "weight": 100}, {"version": "v2", "weight": 0}]},
            "metadata": {"generation": 2},
        }
        await kmock.patch(f"/apis/modelfleet.dev/v1alpha1/namespaces/{NS}/inferencemodels/chat", json=split)

        async def observed_generation():
            return ((await obj(kmock, IM, "chat"))["status"].get("observedGeneration") == 2) or None

        assert await eventually(observed_generation)
        assert (await obj(kmock, "apps/v1/deployments", "chat"))["spec"]["template"] == template
    finally:
        # A graceful stop: kopf waits for the handlers running in its threads, which still talk to kmock.
        stop.set()
        await asyncio.wait_for(task, timeout=30)


async def _every(kmock, resource: str, names: list[str]):
    found = [await obj(kmock, resource, name) for name in names]
    return found if all(found) else None


async def _traffic(kmock, expected: str):
    status = ((await obj(kmock, IM, "chat")) or {}).get("status") or {}
    return status.get("traffic") == expected or None


async def test_kopf_starts_a_rollout_through_the_timer_and_its_filter(emulated_cluster):
    """The rollout timer's registration and `when` filter, with kopf's own keyword arguments: a model
    with spec.rollout gets status.rollout on the timer's first tick (no pods run here: no metrics yet)."""
    kmock = emulated_cluster
    model = (await obj(kmock, IM, "chat")) or {}
    model["spec"]["rollout"] = {"candidate": "v2", "steps": [30, 100]}
    kmock.objects[IM, NS, "chat"] = model
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(standalone=True, clusterwide=True, stop_flag=stop))
    try:

        async def started():
            status = ((await obj(kmock, IM, "chat")) or {}).get("status") or {}
            return status.get("rollout") if status.get("rollout", {}).get("phase") else None

        state = await eventually(started)
        assert state, "the rollout timer never ran"
        assert state["phase"] == "Progressing" and state["step"] == 0
        assert state["traffic"] == [{"version": "v1", "weight": 70}, {"version": "v2", "weight": 30}]
        assert "no running data-plane pod of chat" in state["message"]
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
