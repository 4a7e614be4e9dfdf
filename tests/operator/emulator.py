"""An emulated API server close enough to a real one to see what an operator does at rest.

kmock's emulator stores objects and streams their changes; a fleet at rest also depends on what a real
API server does beyond that: every write gets a new resourceVersion; a write that changes nothing (a
server-side apply of what is already there, a patch to the same values) is no write at all (no new
version, no watch event); a watch resumes from the resourceVersion it is given instead of replaying
everything; and now and then a watch ends with 410 Gone, after which the client lists everything again
(`expire_watches`). The operator tests at scale and `bench/operator_scale.py --kmock` use it.
"""

from __future__ import annotations

import collections
import copy
import datetime as dt
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import dicts

WRITES = ("POST", "PATCH", "PUT", "DELETE")


class ClusterEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1000)
        self._latest = 1000
        self._writes: list[str] = []
        self._gets: collections.Counter[str] = collections.Counter()  # GETs of one object, by plural

    def _next_version(self) -> str:
        self._latest = next(self._versions)
        return str(self._latest)

    async def _handle(self, request: Any) -> Any:
        # kmock keeps every request and matches each new one against all of them (fine for a test of a
        # few dozen, quadratic for a fleet): keep only the one in hand, and a log of the writes.
        del self._requests[:-1]
        if request.method.value in WRITES:
            self._writes.append(f"{request.method.value} {request.url.path}")
        elif request.method.value == "GET" and request.resource is not None and request.name:
            self._gets[request.resource.plural] += 1
        if request.resource is None or request.method.value not in ("POST", "PATCH", "PUT"):
            return await super()._handle(request)
        if request.method.value == "POST":
            return await self._create(request)
        if request.name is None or not isinstance(request.data, (dict, list)):
            return await super()._handle(request)
        return await self._write(request)

    async def _create(self, request: Any) -> Any:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):  # Events are posted with generateName
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
        self._stamp(request.data)
        return await super()._handle(request)

    async def _write(self, request: Any) -> Any:
        """PATCH or PUT of one object (or its status): a new version only when something changed."""
        key = (request.resource, request.namespace, request.name)
        is_apply = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        data = copy.deepcopy(request.data)
        json_patch = isinstance(data, list)  # kopf's: guarded by a `test` of the resourceVersion
        wanted_version = None if json_patch else (data.get("metadata") or {}).pop("resourceVersion", None)
        async with self._lock:
            exists = key in self.objects and not self.objects[key].deleted
            if not exists and not is_apply:
                return _status(404, "NotFound", f"{request.name} not found")
            if not exists:  # server-side apply creates what is missing
                self._stamp(data)
                self.objects[key] = data
                await self._buses[request.resource].put({"type": "ADDED", "object": data})
                return aiohttp.web.json_response(data, status=201)
            current = json.loads(json.dumps(self.objects[key].raw))
            if wanted_version is not None and wanted_version != current["metadata"].get("resourceVersion"):
                return _status(409, "Conflict", "the object has been modified; apply your changes again")
            try:
                changed = dicts.patch_dict(current, data)
            except jsonpatch.JsonPatchTestFailed as exc:
                return _status(422, "Invalid", str(exc))
            if json.dumps(changed, sort_keys=True) == json.dumps(current, sort_keys=True):
                return aiohttp.web.json_response(current)  # a no-op: no new version, no event
            changed = json.loads(json.dumps(changed))
            changed["metadata"]["resourceVersion"] = self._next_version()
            if request.subresource is None and changed.get("spec") != current.get("spec"):
                changed["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            self.objects[key] = changed  # one version kept: a long benchmark keeps no history
            await self._buses[request.resource].put({"type": "MODIFIED", "object": changed})
            return aiohttp.web.json_response(changed)

    def _stamp(self, obj: dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_version()
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        """Store an object as if created earlier (no watch event)."""
        self._stamp(obj)
        self.objects[resource, obj["metadata"].get("namespace"), obj["metadata"]["name"]] = obj

    async def _serve_list(self, request: Any) -> Any:
        listed = await super()._serve_list(request)
        return {**listed, "metadata": {"resourceVersion": str(self._latest)}}

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        if not request.params.get("resourceVersion"):  # a watch without a version starts with everything
            async for item in super()._serve_watch(request):
                yield item
            return
        yield b""
        async for event in self._buses[request.resource]:
            meta = event.get("object", {}).get("metadata", {})
            if request.namespace in (None, meta.get("namespace")):
                yield event

    async def expire_watches(self) -> None:
        """End every watch with 410 Gone, as an API server does when a watch's version is too old."""
        gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
        for resource in list(self._buses):
            await self._buses[resource].put(gone)

    def gets(self, plural: str) -> int:
        """How many GETs of a single object of this resource were made."""
        return self._gets[plural]

    def writes(self) -> list[str]:
        """Requests that could change something ("METHOD /path"): creates, patches, updates, deletes."""
        return list(self._writes)


def _status(code: int, reason: str, message: str) -> Any:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message}
    return aiohttp.web.json_response({**body, "code": code}, status=code)
