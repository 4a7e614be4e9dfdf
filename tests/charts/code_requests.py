"""The API requests the operator and the control plane really make, recorded while their code runs.

The operator's `Kube` is pointed at a small in-memory API (its HTTP layer, `_call`, answered here) and
the reconcile loops and handlers run through a model's life: conversion, serving, scale-fixing, a
rollout, a version's deletion. The control plane's `KubernetesCluster` runs every method of its
`Cluster` interface over a recording store. Each call becomes the request the API server authorizes,
read off the path as the API server does (verb, group, resource, subresource, namespace, name), plus
the checks it makes on the side: `create` for a server-side apply (the object may not exist yet) and
`update` of the owner's finalizers for an ownerReference that blocks deletion.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from controlplane_factories import MemoryStore
from kopf._core.intents import registries
from modelfleet.controlplane import cluster as cp_cluster
from modelfleet.controlplane.models import Model, ModelVersion, Tenant
from modelfleet.operator import handlers, kube, preflight, sync
from modelfleet.operator.api import API_VERSION
from modelfleet.operator.kube import PLURALS, Kube, KubeError
from modelfleet.operator.metrics_source import MetricsSource, ScrapeError
from modelfleet.operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
NS = "team-a"
APPLY = "application/apply-patch+yaml"
# (verb, resource as kubectl writes it, namespace or None, name or None)
Need = tuple[str, str, str | None, str | None]


def _resource(api_version: str, plural: str, subresource: str = "") -> str:
    group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
    return (f"{plural}.{group}" if group else plural) + (f"/{subresource}" if subresource else "")


def path_request(method: str, path: str, query: list[tuple[str, str]] | None = None) -> Need | None:
    """The authorizer's view of one HTTP request (None for discovery, which every account may read)."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) > 2:
        api_version, rest = parts[1], parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        api_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    plural, name = rest[0], rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else ""
    watching = ("watch", "true") in (query or [])
    verb = {
        "GET": "get" if name else ("watch" if watching else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }[method]
    return verb, _resource(api_version, plural, subresource), namespace, name


def _side_checks(verb: str, body: Any, namespace: str | None, name: str | None, resource: str) -> list[Need]:
    needs: list[Need] = []
    if verb == "patch" and isinstance(body, dict) and "/" not in resource:
        needs.append(("create", resource, namespace, name))  # apply creates what is missing
    for ref in (
        ((body or {}).get("metadata") or {}).get("ownerReferences", []) if isinstance(body, dict) else []
    ):
        if ref.get("blockOwnerDeletion"):
            plural = kube.PLURALS[(ref["apiVersion"], ref["kind"])]
            needs.append(
                ("update", _resource(ref["apiVersion"], plural, "finalizers"), namespace, ref["name"])
            )
    return needs


class RecordingKube(Kube):
    """The operator's client over a dict of objects by path; every request it makes is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, dict[str, Any]] = {}
        self.needs: list[Need] = []
        self.discovery = {
            "/apis/kopf.dev/v1": {"resources": [{"name": "clusterkopfpeerings"}, {"name": "kopfpeerings"}]}
        }

    def put(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.objects[kube.resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])] = (
            obj
        )

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        need = path_request(method, path, query)
        if need is None:  # discovery: any authenticated user may read it
            assert method == "GET", f"the operator called {method} {path}: not a resource request"
            if path not in self.discovery:
                raise KubeError(404, f"{path} not served")
            return copy.deepcopy(self.discovery[path])
        self.needs.append(need)
        verb, resource, namespace, name = need
        if content_type == APPLY:
            self.needs += _side_checks(verb, body, namespace, name, resource)
        target = path.removesuffix("/status")
        if method == "GET" and name is None:
            prefix = target + "/"
            items = [
                o for p, o in self.objects.items() if p.startswith(prefix) and "/" not in p[len(prefix) :]
            ]
            return {"items": copy.deepcopy(items)}
        found = self.objects.get(target)
        if method == "PATCH" and content_type == APPLY:
            stored = copy.deepcopy(body)
            if found and "status" in found:
                stored["status"] = found["status"]
            self.objects[target] = stored
            return copy.deepcopy(stored)
        if found is None:
            raise KubeError(404, f"{path} not found")
        if method == "GET":
            return copy.deepcopy(found)
        if method == "DELETE":
            del self.objects[target]
            return {}
        if method == "PATCH" and path.endswith("/status"):
            status = {**(found.get("status") or {}), **body["status"]}
            found["status"] = {k: v for k, v in status.items() if v is not None}
            return copy.deepcopy(found)
        raise AssertionError(f"the in-memory API does not answer {method} {path} ({content_type})")


def _example_objects() -> dict[str, dict[str, Any]]:
    objects = {}
    for index, doc in enumerate(yaml.safe_load_all((ROOT / "examples" / "model.yaml").read_text())):
        doc["metadata"].update(namespace=NS, uid=f"uid-{index}", generation=1, resourceVersion="1")
        objects[doc["metadata"]["name"]] = doc
    return objects


def _finish_jobs(api: RecordingKube) -> None:
    """What the Job controller would do: every Job completes, and its pod is there to be read."""
    for job in list(api.objects.values()):
        if job.get("kind") != "Job":
            continue
        job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
        name = job["metadata"]["name"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-pod", "namespace": NS, "labels": {"job-name": name}},
            "status": {"phase": "Succeeded"},
        }
        api.put(pod)


def operator_needs() -> list[Need]:
    """Every request of the reconcile loops and handlers through one model's life, plus the Events."""
    api = RecordingKube()
    examples = _example_objects()
    for obj in examples.values():
        api.put(obj)
    settings = OperatorSettings(
        dataplane_image="registry.example/modelfleet:1", dataplane_api_keys_secret="k"
    )

    def record(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        # kopf posts each Event with core/v1 into the object's namespace.
        api.needs.append(("create", "events", obj["metadata"]["namespace"], None))

    ctx = sync.Context(kube=api, settings=settings, record=record)
    im = copy.deepcopy(examples["chat"])
    sync.reconcile_model(ctx, copy.deepcopy(im))  # conversion Jobs, serving objects, status
    sync.reconcile_model(ctx, copy.deepcopy(im))  # Jobs without pods: their Events may say why
    _finish_jobs(api)
    sync.reconcile_model(ctx, copy.deepcopy(im))  # the Jobs' pods are read
    with contextlib.suppress(ScrapeError):  # none is running: the scrape lists the pods and gives up
        MetricsSource(api, settings.dataplane_port)(NS, "chat")
    fixed = copy.deepcopy(im)
    fixed["spec"]["replicas"] = {"min": 2, "max": 2}
    sync.reconcile_model(ctx, fixed)  # the HPA is deleted
    canary = copy.deepcopy(im)
    canary["spec"]["rollout"] = {"candidate": "v2"}
    api.put(canary)
    sync.step_rollout(ctx, copy.deepcopy(canary))
    version = api.objects[kube.resource_path(API_VERSION, "ModelVersion", NS, "chat-v2")]
    sync.mark_in_use(ctx, version, sync.traffic_holders(api, version))
    memo, log = SimpleNamespace(ctx=ctx), logging.getLogger("rbac-needs")
    job = next(o for o in api.objects.values() if o["kind"] == "Job")
    deployment = next(o for o in api.objects.values() if o["kind"] == "Deployment")
    handlers.job_event(body=job, memo=memo, logger=log)
    handlers.serving_child_event(body=deployment, memo=memo, logger=log)
    handlers.version_event(body=version, memo=memo, logger=log, type="DELETED")
    return api.needs


class RecordingStore(MemoryStore):
    """The control plane's store, turning each call into the request KubeStore would send."""

    # The kinds the control plane writes, by name: the rest of the client's path table is the operator's.
    KINDS = frozenset({"Namespace", "ResourceQuota", "Secret", "InferenceModel", "ModelVersion"})

    def __init__(self) -> None:
        super().__init__()
        self.needs: list[Need] = []

    def _need(self, verb: str, api_version: str, kind: str, namespace: str | None, name: str | None) -> str:
        plural = PLURALS.get((api_version, kind)) if kind in self.KINDS else None
        assert plural, f"the control plane touches {kind} ({api_version}): add it here and to its RBAC"
        resource = _resource(api_version, plural)
        self.needs.append((verb, resource, namespace, name))
        return resource

    def apply(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        resource = self._need("patch", body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"])
        self.needs += _side_checks("patch", body, meta.get("namespace"), meta["name"], resource)
        super().apply(body)

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> None:
        self._need("delete", api_version, kind, namespace, name)
        super().delete(api_version, kind, name, namespace)

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        self._need("get", api_version, kind, namespace, name)
        return super().get(api_version, kind, name, namespace)

    def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        self._need("list", api_version, kind, namespace, None)
        return super().list(api_version, kind, namespace, labels)


def control_plane_needs() -> tuple[list[Need], set[str]]:
    """Every request of every `Cluster` method, and the names of the methods that were run."""
    store = RecordingStore()
    cluster = cp_cluster.KubernetesCluster(store)
    tenant = Tenant(name="acme", namespace=NS, gpu_quota=4, token_rate_limit=1000, allowed_models=[])
    model = Model(
        name="chat",
        accelerator="nvidia-h100",
        gpu_count=1,
        min_replicas=1,
        max_replicas=2,
        sticky_by="user",
        loading="eager",
        traffic=[{"version": "v1", "weight": 100}],
    )
    version = ModelVersion(
        name="v1",
        source_uri="s3://bucket/chat/v1",
        source_format="hf-safetensors",
        digest="c" * 64,
        quantization="none",
        targets=[{"accelerator": "nvidia-h100", "format": "torch", "dtype": "bf16"}],
    )
    calls = {
        "apply_tenant": lambda: cluster.apply_tenant(tenant, ["aaaaaaaa"]),
        "apply_keys": lambda: cluster.apply_keys(tenant, ["aaaaaaaa"], ("bbbbbbbb", "1" * 64)),
        "apply_model": lambda: cluster.apply_model(tenant, model),
        "apply_version": lambda: cluster.apply_version(tenant, model, version),
        "model_status": lambda: cluster.model_status(tenant, "chat"),
        "model_statuses": lambda: cluster.model_statuses(tenant),
        "version_status": lambda: cluster.version_status(tenant, "chat", "v1"),
        "version_statuses": lambda: cluster.version_statuses(tenant, "chat"),
        "delete_version": lambda: cluster.delete_version(tenant, model, version),
        "delete_model": lambda: cluster.delete_model(tenant, model),
        "delete_tenant": lambda: cluster.delete_tenant(tenant),
    }
    for call in calls.values():
        call()
    return store.needs, set(calls)


def preflight_needs(served: str | None, peering: str) -> list[Need]:
    """The start-up check that the peering object kopf waits for exists (operator/preflight.py)."""
    api = RecordingKube()
    objects = preflight.peering_objects(peering, [served] if served else [], clusterwide=served is None)
    assert objects, "the preflight looks for no peering object"
    preflight.check_peering(api, objects)
    return api.needs


def kopf_needs(served: str | None, peering: str) -> list[Need]:
    """What kopf itself asks for, serving every namespace (`served` None) or one: it discovers CRDs (and,
    serving a list, namespaces), lists and watches every resource a handler or index is registered for,
    patches the objects it keeps progress and finalizers on, keeps alive in its peering object and posts
    Events."""
    registry = registries.get_default_registry()  # filled by importing handlers
    needs: list[Need] = [
        (v, "customresourcedefinitions.apiextensions.k8s.io", None, None) for v in ("list", "watch")
    ]
    if served is not None:
        needs += [(v, "namespaces", None, None) for v in ("list", "watch")]
    peerings = "clusterkopfpeerings.kopf.dev" if served is None else "kopfpeerings.kopf.dev"
    needs += [
        ("list", peerings, served, None),
        ("watch", peerings, served, None),
        ("patch", peerings, served, peering),
    ]
    stateful = [*registry._changing.get_all_handlers(), *registry._spawning.get_all_handlers()]
    watching = [*registry._watching.get_all_handlers(), *registry._indexing.get_all_handlers()]
    for handler in [*watching, *stateful]:
        if not handler.fn.__module__.startswith("modelfleet.operator."):
            continue  # registered by something else in this process, not by the operator
        selector = handler.selector
        plural = selector.plural or selector.any_name
        resource = f"{plural}.{selector.group}" if selector.group else plural
        needs += [("list", resource, served, None), ("watch", resource, served, None)]
        if handler in stateful:
            needs.append(("patch", resource, served or NS, "chat"))
    needs.append(("create", "events", served or NS, None))
    return needs
