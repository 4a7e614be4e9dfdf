"""The control plane's cluster client (the operator's `Kube` under the control plane's field manager),
against kmock's emulated API server: server-side apply, reads and deletes over HTTP, no cluster needed."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from typing import Any

import aiohttp.web
import kmock
import pytest
from controlplane_factories import ADMIN, Factory, make_settings
from fastapi.testclient import TestClient
from kubernetes import client as k8s
from modelfleet.controlplane.cluster import KubernetesCluster, KubeStore
from modelfleet.controlplane.main import create_app

IM = "modelfleet.dev/v1alpha1/inferencemodels"
MV = "modelfleet.dev/v1alpha1/modelversions"
RESOURCES = {
    "v1/namespaces": ("Namespace", False),
    "v1/resourcequotas": ("ResourceQuota", True),
    "v1/secrets": ("Secret", True),
    IM: ("InferenceModel", True),
    MV: ("ModelVersion", True),
}


class ApplyingEmulator(kmock.KubernetesEmulator):
    """kmock plus what a real API server does and kmock does not: server-side apply creates what is
    missing, lists carry a kind, and Namespace objects exist (kmock reads /api/v1/namespaces/<name> as
    a namespace prefix, not as an object)."""

    namespace_objects: dict[str, dict]

    async def _handle(self, request: Any) -> Any:
        found = NAMESPACE_PATH.match(request.url.path)
        if found:
            return self._namespace(request, found.group(1))
        is_apply = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        if is_apply and request.resource is not None and request.name and request.data:
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                self.objects[key] = request.data
        return await super()._handle(request)

    async def _serve_list(self, request: Any) -> Any:
        # A real API server names the list's kind; the dynamic client relies on it.
        return {"apiVersion": "v1", "kind": "List", **await super()._serve_list(request)}

    def _namespace(self, request: Any, name: str) -> aiohttp.web.Response:
        objects = self.__dict__.setdefault("namespace_objects", {})
        method = request.method.value
        if method == "PATCH":
            objects[name] = request.data
        elif method == "DELETE":
            objects.pop(name, None)
        if name not in objects:
            return aiohttp.web.json_response(
                {"kind": "Status", "code": 404, "reason": "NotFound"}, status=404
            )
        return aiohttp.web.json_response(objects[name])


NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)$")
pytestmark = pytest.mark.kmock(cls=ApplyingEmulator)


async def stored(emulator, resource: str, namespace: str, name: str) -> dict | None:
    """The object as the emulated API server returns it (None when absent)."""
    group_version, plural = resource.rsplit("/", 1)
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    response = await emulator.get(f"{base}/namespaces/{namespace}/{plural}/{name}")
    return await response.json() if response.status == 200 else None


async def test_writes_reach_the_api_server_as_objects(kmock, tmp_path):
    for resource, (kind, namespaced) in RESOURCES.items():
        kmock.resources[resource] = {"kind": kind, "namespaced": namespaced}
    config = k8s.Configuration()
    config.host = str(kmock.url).rstrip("/")
    cluster = KubernetesCluster(KubeStore(k8s.ApiClient(config)), where="(kmock)")
    app = create_app(make_settings(f"sqlite:///{tmp_path}/cp.db"), cluster=cluster)

    def through_the_api() -> str:
        with TestClient(app) as client:
            factory = Factory(client)
            factory.tenant("acme", gpu_quota=2)
            token = factory.key("acme")["key"]
            factory.model("acme", name="chat")
            factory.version("acme", "chat", "v1")
            factory.traffic("acme", "chat", {"v1": 100})
            return token

    token = await asyncio.to_thread(through_the_api)
    assert kmock.namespace_objects["acme"]["metadata"]["labels"]["modelfleet.dev/tenant"] == "acme"
    quota = await stored(kmock, "v1/resourcequotas", "acme", "modelfleet-quota")
    assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == "2"
    secret = await stored(kmock, "v1/secrets", "acme", "modelfleet-api-keys")
    entries = json.loads(base64.b64decode(secret["data"]["keys"]))
    assert [e["sha256"] for e in entries] == [hashlib.sha256(token.encode()).hexdigest()]
    im = await stored(kmock, IM, "acme", "chat")
    assert im["spec"]["traffic"] == [{"version": "v1", "weight": 100}]
    mv = await stored(kmock, MV, "acme", "chat-v1")
    assert mv["spec"]["version"] == "v1"
    applies = [r for r in list(kmock) if r.method.value == "PATCH"]
    assert applies and all(r.params.get("fieldManager") == "modelfleet-controlplane" for r in applies)

    # The operator reports status; reads merge it. Deleting takes the objects away.
    kmock.objects[IM, "acme", "chat"] = {**im, "status": {"endpoint": "http://chat.acme.svc:8000"}}

    def read_then_delete() -> dict[str, Any]:
        with TestClient(app) as client:
            model = client.get("/api/v1/tenants/acme/models/chat", headers=ADMIN).json()
            assert client.delete("/api/v1/tenants/acme/models/chat", headers=ADMIN).status_code == 204
            assert client.delete("/api/v1/tenants/acme", headers=ADMIN).status_code == 204
            return model

    model = await asyncio.to_thread(read_then_delete)
    assert model["status"] == {"endpoint": "http://chat.acme.svc:8000"}
    assert await stored(kmock, IM, "acme", "chat") is None
    assert await stored(kmock, MV, "acme", "chat-v1") is None
    assert "acme" not in kmock.namespace_objects  # the tenant's namespace goes with the tenant
