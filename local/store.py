"""An in-memory stand-in for the Kubernetes API behind `operator/kube.py`'s `Kube`.

Same methods and errors as `Kube` (get, list, apply, delete, patch_status, raising `KubeError`), and the
server-side behaviour the operator relies on: uid, resourceVersion, generation bumped on spec changes only,
creationTimestamp, a status subresource that apply never touches, a no-op apply that changes nothing,
compare-and-swap on resourceVersion, and garbage collection of owned objects on delete.
"""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable
from typing import Any

from modelfleet.operator.kube import KubeError
from modelfleet.operator.reconcile.conditions import now_rfc3339

Key = tuple[str, str, str, str]  # (apiVersion, kind, namespace, name)
# Fields the API server owns: an applied object never sets them.
MAX_EVENTS = 500
SERVER_METADATA = ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp")


def key_of(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta.get("namespace", "default"), meta["name"]


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, None removes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = _merge_patch(result.get(name), value)
    return result


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    """What a change of bumps metadata.generation: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


class LocalKube:
    """The object store. Thread-safe; `changes` counts writes so loops can wait for the next one."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._objects: dict[Key, dict[str, Any]] = {}
        self._events: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        self._version = 0
        self.changed = threading.Condition(self._lock)
        self._on_change = on_change

    # --- Kube's interface ------------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            obj = self._objects.get((api_version, kind, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        with self._lock:
            found = [
                copy.deepcopy(obj)
                for (av, k, ns, _), obj in sorted(self._objects.items())
                if av == api_version and k == kind and ns == namespace
                and all(obj["metadata"].get("labels", {}).get(lk) == lv for lk, lv in (labels or {}).items())
            ]  # fmt: skip
        return found

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply by the one field manager: the applied fields replace the stored ones."""
        key = key_of(obj)
        with self._lock:
            old = self._objects.get(key)
            new = copy.deepcopy({k: v for k, v in obj.items() if k != "status"})
            meta = {k: v for k, v in new.get("metadata", {}).items() if k not in SERVER_METADATA}
            meta.setdefault("namespace", key[2])
            if old is None:
                meta.update(
                    uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_rfc3339(), resourceVersion=""
                )
                new["metadata"] = meta
                _defaults(new, None)
                return self._store(key, new)
            for field in SERVER_METADATA:
                if field in old["metadata"]:
                    meta[field] = old["metadata"][field]
            new["metadata"] = meta
            _defaults(new, old)
            if "status" in old:
                new["status"] = old["status"]
            if new == old:  # an unchanged apply writes nothing, so nothing loops
                return copy.deepcopy(old)
            if _spec_part(new) != _spec_part(old):
                meta["generation"] = old["metadata"].get("generation", 1) + 1
            return self._store(key, new)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete if present, and (background propagation) everything it owns; False when already gone."""
        with self._lock:
            obj = self._objects.pop((api_version, kind, namespace, name), None)
            if obj is None:
                return False
            self._collect(obj["metadata"]["uid"])
            self._bump()
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
        key = (api_version, kind, namespace, name)
        with self._lock:
            old = self._objects.get(key)
            if old is None:
                raise KubeError(404, f'{kind.lower()}s "{name}" not found')
            if resource_version is not None and resource_version != old["metadata"]["resourceVersion"]:
                raise KubeError(
                    409,
                    f'Operation cannot be fulfilled on {kind.lower()}s "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            merged = _merge_patch(old.get("status") or {}, status)
            if merged == old.get("status"):
                return copy.deepcopy(old)
            return self._store(key, {**old, "status": merged})

    def list_events(
        self, namespace: str, kind: str, name: str, uid: str | None = None
    ) -> list[dict[str, Any]]:
        """The core/v1 Events about one object."""
        with self._lock:
            return [
                copy.deepcopy(e)
                for e in self._events
                if e["metadata"]["namespace"] == namespace
                and e["involvedObject"]["kind"] == kind
                and e["involvedObject"]["name"] == name
                and (uid is None or e["involvedObject"].get("uid") == uid)
            ]

    # --- what the local controllers and the CLI use ----------------------------------------------------

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about `obj`, as kopf and the controllers post them (the latest MAX_EVENTS)."""
        meta = obj["metadata"]
        now = now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                               "name": meta["name"], "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }  # fmt: skip
        with self._lock:
            self._events = [*self._events[-(MAX_EVENTS - 1) :], event]

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(self._events)

    def put_status(self, obj: dict[str, Any], status: dict[str, Any]) -> None:
        """Replace an object's whole status (a controller's write); no-op when gone or unchanged."""
        key = key_of(obj)
        with self._lock:
            old = self._objects.get(key)
            if old is not None and old.get("status") != status:
                self._store(key, {**old, "status": copy.deepcopy(status)})

    def all(self, api_version: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        """Every object (of one kind, when given), in every namespace."""
        with self._lock:
            return [
                copy.deepcopy(obj)
                for (av, k, _, _), obj in sorted(self._objects.items())
                if (kind is None or k == kind) and (api_version is None or av == api_version)
            ]

    @property
    def version(self) -> int:
        return self._version

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Block until a write after `seen` (or `timeout`); returns the current version."""
        with self.changed:
            self.changed.wait_for(lambda: self._version != seen, timeout=timeout)
            return self._version

    def _store(self, key: Key, obj: dict[str, Any]) -> dict[str, Any]:
        self._bump()
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._objects[key] = obj
        return copy.deepcopy(obj)

    def _bump(self) -> None:
        self._version += 1
        self.changed.notify_all()
        if self._on_change is not None:
            self._on_change()

    def _collect(self, uid: str) -> None:
        owned = [
            key
            for key, obj in self._objects.items()
            if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences", []))
        ]
        for key in owned:
            child = self._objects.pop(key, None)
            if child is not None:
                self._collect(child["metadata"]["uid"])


def _defaults(new: dict[str, Any], old: dict[str, Any] | None) -> None:
    """The defaults the API server fills in that the operator's reads depend on."""
    if new.get("kind") == "Deployment":
        spec = new.setdefault("spec", {})
        if "replicas" not in spec:  # an HPA owns it then: keep what is there
            spec["replicas"] = ((old or {}).get("spec") or {}).get("replicas", 1)
