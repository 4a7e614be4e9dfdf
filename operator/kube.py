"""The operator's thin I/O edge to the Kubernetes API: get, list, server-side apply, delete, patch status.

Plain dicts in and out over the kubernetes client's REST layer, one path table for the kinds we touch,
so the same code runs against a real API server and the kmock emulator in the tests.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import urllib3
from kubernetes import client
from modelfleet.operator.api import API_VERSION
from modelfleet.operator.reconcile.names import FIELD_MANAGER

PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("apps/v1", "Deployment"): "deployments",
    ("batch/v1", "Job"): "jobs",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    (API_VERSION, "InferenceModel"): "inferencemodels",
    (API_VERSION, "ModelVersion"): "modelversions",
    # What the control plane writes for a tenant.
    ("v1", "Namespace"): "namespaces",
    ("v1", "Secret"): "secrets",
    ("v1", "ResourceQuota"): "resourcequotas",
    # Applied by the end-to-end tests through this client before anything else.
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
}
CLUSTER_SCOPED = frozenset({"Namespace", "CustomResourceDefinition"})
TIMEOUT = 30
APPLIED = "modelfleet.dev/applied"  # annotation: a digest of what the operator last applied


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0 when the server could not be reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    plural = PLURALS[(api_version, kind)]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/{plural}" if kind in CLUSTER_SCOPED else f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    def __init__(
        self,
        api_client: client.ApiClient | None = None,
        on_request: Callable[[str], None] | None = None,
        field_manager: str = FIELD_MANAGER,
    ) -> None:
        """`field_manager`: who server-side applies (the control plane, which shares this client, is
        another manager than the operator)."""
        self.api = api_client or client.ApiClient()
        self.field_manager = field_manager
        self.on_request = on_request  # called with the HTTP method of each request (the operator counts them)
        self._journal = threading.local()

    @contextmanager
    def journal(self, note: Callable[[dict[str, Any]], None]) -> Iterator[None]:
        """Call `note(metadata)` for every object this thread reads or writes meanwhile: the versions a
        reconcile has seen, so that their watch events can be told apart from news."""
        outer = getattr(self._journal, "note", None)
        self._journal.note = note
        try:
            yield
        finally:
            self._journal.note = outer

    def _note(self, obj: dict[str, Any]) -> dict[str, Any]:
        note = getattr(self._journal, "note", None)
        if note is not None and obj.get("metadata"):
            note(obj["metadata"])
        return obj

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        method, url, headers, payload, post = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        if self.on_request is not None:
            self.on_request(method)
        try:
            response = self.api.call_api(
                method, url, header_params=headers, body=payload, post_params=post, _request_timeout=TIMEOUT
            )
            raw = response.read()
        except client.ApiException as exc:
            raise KubeError(exc.status or 0, _message(exc.status or 0, exc.body, str(exc.reason))) from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # refused, DNS, TLS, retries: unreachable
            raise KubeError(0, f"{method} {path}: {exc}") from None
        if not 200 <= response.status < 300:
            raise KubeError(response.status, _message(response.status, raw, f"{method} {path}"))
        return json.loads(raw) if raw else {}

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._note(self._call("GET", resource_path(api_version, kind, namespace, name)))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items()))] if labels else []
        try:
            items = self._call("GET", resource_path(api_version, kind, namespace), query=query).get(
                "items", []
            )
        except KubeError as exc:
            if exc.status == 404:
                return []
            raise
        # Filter again: a selector is a request to the server, and not every server honours it.
        return [
            self._note(i)
            for i in items
            if all(i.get("metadata", {}).get("labels", {}).get(k) == v for k, v in (labels or {}).items())
        ]

    def list_events(
        self, namespace: str, kind: str, name: str, uid: str | None = None
    ) -> list[dict[str, Any]]:
        """The core/v1 Events about one object (e.g. a Job's FailedCreate), in no particular order."""
        fields = {"involvedObject.kind": kind, "involvedObject.name": name}
        if uid:  # a re-created object of the same name must not inherit the old one's events
            fields["involvedObject.uid"] = uid
        query = [("fieldSelector", ",".join(f"{k}={v}" for k, v in fields.items()))]
        try:
            items = self._call("GET", f"/api/v1/namespaces/{namespace}/events", query=query).get("items", [])
        except KubeError as exc:
            if exc.status == 404:
                return []
            raise
        # Filter again, as `list` does with labels.
        return [
            e
            for e in items
            if all((e.get("involvedObject") or {}).get(k.split(".", 1)[1]) == v for k, v in fields.items())
        ]

    def get_path(self, path: str) -> dict[str, Any] | None:
        """GET any API path (discovery, cluster-scoped or foreign kinds); None on 404."""
        try:
            return self._call("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with our one field manager; force takes over fields we used to share."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = [("fieldManager", self.field_manager), ("force", "true")]
        return self._note(
            self._call("PATCH", path, body=obj, query=query, content_type="application/apply-patch+yaml")
        )

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete if present; False when it was already gone."""
        try:
            self._call(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """JSON merge patch of the status subresource (None values remove keys).

        With `resource_version` the write happens only if the object is still at that version (the API
        server answers 409 Conflict otherwise): a compare-and-swap for state kept in status.
        """
        path = resource_path(api_version, kind, namespace, name) + "/status"
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return self._note(self._call("PATCH", path, body=body, content_type="application/merge-patch+json"))


def status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch turning status `old` into `new` (None when they are equal)."""
    old = old or {}
    if old == new:
        return None
    patch: dict[str, Any] = {key: value for key, value in new.items() if old.get(key) != value}
    patch.update({key: None for key in old if key not in new})
    return patch


def matches(live: Any, desired: Any) -> bool:
    """Whether the live object already holds every field of `desired` (what we would apply).

    The API server adds defaults and drops empty values, and gives quantities back as strings (a GPU
    count 1 comes back as "1"), so: extra live fields are fine, an empty desired value matches an absent
    one, and a number matches its string form. Anything else that differs is drift, and is applied.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return not desired and live is None
        return all(
            matches(live[key], value) if key in live else _empty(value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(matches(a, b) for a, b in zip(live, desired, strict=True))
        ) or (live is None and not desired)
    if live == desired:
        return True
    numbers = (int, float)
    if isinstance(desired, numbers) and not isinstance(desired, bool) and isinstance(live, str):
        return live == str(desired)
    return False


def with_digest(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` annotated with a digest of itself. `matches` alone would miss a field the operator stopped
    setting (the live object still holds every desired field); the digest differs then, so it is applied."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
    meta = obj["metadata"]
    return {**obj, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), APPLIED: digest}}}


def _empty(value: Any) -> bool:
    return value is None or value == "" or value == {} or value == []


def _message(status: int, body: bytes | str | None, fallback: str) -> str:
    """The API server's own message from a Status body, else the HTTP status."""
    try:
        message = json.loads(body or b"").get("message")
    except (TypeError, ValueError, AttributeError):
        message = None
    return str(message) if message else f"{status} {fallback}"
