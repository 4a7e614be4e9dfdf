"""Test data for the control-plane tests: an in-memory Kubernetes object store, settings, and factories
that make tenants, keys, models and versions through the API with unique names."""

from __future__ import annotations

import base64
import copy
import itertools
import json
from typing import Any

from fastapi.testclient import TestClient
from modelfleet.controlplane.core.config import Settings
from modelfleet.controlplane.errors import ClusterConflict

ADMIN_KEY = "test-admin-key-0123456789abcdef"
PEPPER = "test-pepper-0123456789abcdef"


class MemoryStore:
    """The Kubernetes API as a dict. Like server-side apply, an apply keeps the object's status (the
    operator's part) and is refused when it names a resourceVersion that is no longer current."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}
        self.fail_with: Exception | None = None
        self.versions = itertools.count(1)

    def _key(self, api_version: str, kind: str, name: str, namespace: str | None) -> tuple:
        return (api_version, kind, namespace, name)

    def apply(self, body: dict[str, Any]) -> None:
        if self.fail_with:
            raise self.fail_with
        meta = body["metadata"]
        key = self._key(body["apiVersion"], body["kind"], meta["name"], meta.get("namespace"))
        existing = self.objects.get(key)
        expected = meta.get("resourceVersion")
        if expected and (existing is None or existing["metadata"]["resourceVersion"] != expected):
            raise ClusterConflict(f"{body['kind']} {meta['name']} changed meanwhile")
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(next(self.versions))
        if existing and "status" in existing:
            stored["status"] = existing["status"]
        self.objects[key] = stored

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> None:
        if self.fail_with:
            raise self.fail_with
        self.objects.pop(self._key(api_version, kind, name, namespace), None)
        if kind == "Namespace":  # a namespace takes its objects with it
            for key in [k for k in self.objects if k[2] == name]:
                del self.objects[key]

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        found = self.objects.get(self._key(api_version, kind, name, namespace))
        return copy.deepcopy(found) if found else None

    def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (av, k, ns, _), obj in self.objects.items()
            if (av, k, ns) == (api_version, kind, namespace)
            and all(obj["metadata"].get("labels", {}).get(lk) == lv for lk, lv in labels.items())
        ]

    def find(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        for (_, k, ns, n), obj in self.objects.items():
            if (k, n, ns) == (kind, name, namespace):
                return obj
        return None


def make_settings(database_url: str, **overrides: Any) -> Settings:
    fields = {"admin_key": ADMIN_KEY, "key_pepper": PEPPER, "cluster": "none", **overrides}
    return Settings(database_url=database_url, **fields)


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Factory:
    """Test data made through the API, with unique names, returning what later calls need."""

    _ids = itertools.count(1)

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def unique(self, stem: str) -> str:
        return f"{stem}{next(self._ids)}"

    def _ok(self, response: Any) -> dict[str, Any]:
        assert response.status_code < 300, response.text
        return response.json() if response.content else {}

    def tenant(self, name: str | None = None, **fields: Any) -> str:
        name = name or self.unique("team")
        self._ok(self.client.post("/api/v1/tenants", json={"name": name, **fields}, headers=ADMIN))
        return name

    def key(self, tenant: str, **fields: Any) -> dict[str, Any]:
        return self._ok(self.client.post(f"/api/v1/tenants/{tenant}/keys", json=fields, headers=ADMIN))

    def tenant_with_key(self, **fields: Any) -> tuple[str, dict[str, str]]:
        tenant = self.tenant(**fields)
        return tenant, bearer(self.key(tenant)["key"])

    def model(
        self, tenant: str, headers: dict[str, str] = ADMIN, name: str | None = None, **fields: Any
    ) -> str:
        name = name or self.unique("model")
        body = {"name": name, **fields}
        self._ok(self.client.post(f"/api/v1/tenants/{tenant}/models", json=body, headers=headers))
        return name

    def version(
        self, tenant: str, model: str, version: str, headers: dict[str, str] = ADMIN, **fields: Any
    ) -> dict[str, Any]:
        body = {"version": version, "source": {"uri": f"pvc://models/{model}/{version}"}, **fields}
        url = f"/api/v1/tenants/{tenant}/models/{model}/versions"
        return self._ok(self.client.post(url, json=body, headers=headers))

    def traffic(
        self, tenant: str, model: str, split: dict[str, int], headers: dict[str, str] = ADMIN, **fields
    ):
        body = {"traffic": [{"version": v, "weight": w} for v, w in split.items()], **fields}
        url = f"/api/v1/tenants/{tenant}/models/{model}/traffic"
        return self._ok(self.client.post(url, json=body, headers=headers))

    def served_model(self, tenant: str, headers: dict[str, str] = ADMIN) -> str:
        """A model with versions v1 and v2 and a 90/10 split."""
        model = self.model(tenant, headers)
        self.version(tenant, model, "v1", headers)
        self.version(tenant, model, "v2", headers, parent="v1")
        self.traffic(tenant, model, {"v1": 90, "v2": 10}, headers)
        return model


def key_file(store: MemoryStore, tenant: str) -> list[dict[str, Any]]:
    """The entries of a tenant's key Secret, as the data plane reads them."""
    secret = store.find("Secret", "modelfleet-api-keys", tenant)
    return json.loads(base64.b64decode(secret["data"]["keys"])) if secret else []
