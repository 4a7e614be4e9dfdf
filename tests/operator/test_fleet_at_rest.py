"""A fleet at rest, with kopf itself running our handlers against an API server that behaves like one
(resourceVersions, no-op writes that are no writes, watches that expire and make kopf list everything
again): nothing changes, so the operator writes nothing and reconciles each model at most once per
resync interval; and what someone breaks meanwhile is still repaired."""

from __future__ import annotations

import asyncio
import dataclasses

import kopf
import modelfleet.operator.handlers as handlers
import pytest
import yaml
from emulator import ClusterEmulator
from kubernetes.config import kube_config
from modelfleet.operator.observability import RECONCILES

NS = "fleet"
MODELS = 6
RESYNC = 1.5
IM, MV = "modelfleet.dev/v1alpha1/inferencemodels", "modelfleet.dev/v1alpha1/modelversions"
CHILDREN = {
    "apps/v1/deployments": "Deployment",
    "v1/services": "Service",
    "v1/configmaps": "ConfigMap",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "autoscaling/v2/horizontalpodautoscalers": "HorizontalPodAutoscaler",
    "batch/v1/jobs": "Job",
    "v1/pods": "Pod",
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}

pytestmark = pytest.mark.kmock(cls=ClusterEmulator)


def model(name: str, autoscaled: bool) -> tuple[dict, dict]:
    im = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "hardware": {"accelerator": "nvidia-h100", "count": 1},
            "replicas": {"min": 1, "max": 2 if autoscaled else 1},
            "traffic": [{"version": "v1", "weight": 100}],
        },
    }
    mv = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "ModelVersion",
        "metadata": {"name": f"{name}-v1", "namespace": NS},
        "spec": {
            "model": name,
            "version": "v1",
            "source": {"uri": f"pvc://models/{name}/v1", "format": "hf-safetensors"},
        },
    }
    return im, mv


@pytest.fixture()
def fleet(kmock, tmp_path, monkeypatch):
    for resource, kind in {
        IM: "InferenceModel",
        MV: "ModelVersion",
        **CHILDREN,
        "v1/events": "Event",
    }.items():
        kmock.resources[resource] = {
            "kind": kind,
            "namespaced": True,
            "verbs": VERBS,
            "subresources": {"status"},
        }
    for resource, kind in {
        "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
        "v1/namespaces": "Namespace",
    }.items():
        kmock.resources[resource] = {"kind": kind, "namespaced": False, "verbs": VERBS}
    for index in range(MODELS):
        im, mv = model(f"m{index}", autoscaled=index % 2 == 0)
        kmock.put(IM, im)
        kmock.put(MV, mv)
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
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # A short resync, for the registered timer and for the handlers that read it.
    spawning = kopf.get_default_registry()._spawning
    timers = [
        dataclasses.replace(h, interval=RESYNC, initial_delay=RESYNC, idle=RESYNC / 2)
        if h.id == "model_resync"
        else h
        for h in spawning.get_all_handlers()
    ]
    monkeypatch.setattr(spawning, "_handlers", timers)
    monkeypatch.setattr(handlers, "RESYNC_SKIP_SECONDS", RESYNC / 2)
    return kmock


def reconciles() -> float:
    return sum(s.value for m in RECONCILES.collect() for s in m.samples if s.name.endswith("_total"))


async def fetch(kmock, path: str) -> dict | None:
    response = await kmock.get(path)
    return await response.json() if response.status == 200 else None


async def converged(kmock) -> bool:
    for index in range(MODELS):
        im = await fetch(kmock, f"/apis/modelfleet.dev/v1alpha1/namespaces/{NS}/inferencemodels/m{index}")
        if not (im.get("status") or {}).get("traffic"):
            return False
        if await fetch(kmock, f"/apis/apps/v1/namespaces/{NS}/deployments/m{index}") is None:
            return False
    return True


async def until(probe, timeout: float = 15.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await probe():
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_fleet_at_rest_writes_nothing_and_reconciles_once_per_resync(fleet):
    kmock = fleet
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(standalone=True, clusterwide=True, stop_flag=stop))
    try:
        assert await until(lambda: converged(kmock)), "the fleet never got its children and status"
        await asyncio.sleep(1.0)  # the last events of the start settle

        writes, runs = len(kmock.writes()), reconciles()
        reads = {plural: kmock.gets(plural) for plural in ("deployments", "services", "configmaps")}
        window = 3 * RESYNC
        await kmock.expire_watches()  # kopf lists everything again: every object arrives once more
        await asyncio.sleep(window / 2)
        await kmock.expire_watches()
        await asyncio.sleep(window / 2)

        made = kmock.writes()[writes:]
        per_model = (reconciles() - runs) / MODELS
        assert made == [], f"at rest: {len(made)} writes, {per_model:.1f} reconciles a model: {made[:6]}"
        assert per_model <= window / RESYNC + 1, f"{per_model:.1f} reconciles per model in {window}s"
        # The resyncs found the watched serving objects as they should be in the watch's view: no GETs.
        assert per_model >= 1 and {plural: kmock.gets(plural) for plural in reads} == reads

        # Still convergent: what is deleted or edited behind the operator's back is put back.
        await kmock.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/m1")
        await kmock.patch(
            f"/api/v1/namespaces/{NS}/configmaps/m2-manifest", json={"data": {"manifest.yaml": "x"}}
        )

        async def repaired():
            deployment = await fetch(kmock, f"/apis/apps/v1/namespaces/{NS}/deployments/m1")
            configmap = await fetch(kmock, f"/api/v1/namespaces/{NS}/configmaps/m2-manifest")
            return deployment is not None and configmap["data"]["manifest.yaml"] != "x"

        assert await until(repaired, timeout=20), "a deleted Deployment or an edited ConfigMap stayed so"
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
