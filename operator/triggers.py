"""Which triggers still need a reconcile: the bookkeeping that lets an idle fleet cost next to nothing.

kopf calls an event handler for every watch event, and a watch brings more than news: the operator's own
writes come back as events, and whenever a watch expires kopf lists everything again, which replays
every object once more. A reconcile reads everything fresh, so a trigger is redundant when

- its object is at a resourceVersion some successful reconcile already read or wrote (`is_news`), or
- a reconcile of the same model began after the trigger arrived and succeeded (`turn` yields False).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

MAX_REMEMBERED = 200_000  # objects; past that, forget all (the cost: one reconcile more per object)


class Triggers:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        # uid -> (resourceVersion, generation, being deleted) of what a reconcile has seen
        self._versions: dict[str, tuple[str, Any, bool]] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._done: dict[tuple[str, str], float] = {}  # model -> start of its last successful reconcile

    def is_news(self, body: Mapping[str, Any], type_: str | None, spec_only: bool = False) -> bool:
        """Whether a watch event can tell a reconcile anything it has not seen. `spec_only`: only the
        spec and the deletion matter (a ModelVersion: its status is ours, and kopf's finalizer or an
        annotation changes nothing), so a new version of the same generation is no news either."""
        meta = body.get("metadata") or {}
        uid, version = meta.get("uid"), meta.get("resourceVersion")
        if type_ == "DELETED":
            with self._guard:
                self._versions.pop(uid, None)
            return True
        known = self._versions.get(uid) if uid and version else None
        if known is None:
            return True
        if spec_only:
            return (known[1], known[2]) != (meta.get("generation"), bool(meta.get("deletionTimestamp")))
        return known[0] != version

    def remember(self, meta: Mapping[str, Any]) -> None:
        """The metadata of an object a reconcile read or wrote: events of that version are no news."""
        if not (meta.get("uid") and meta.get("resourceVersion")):
            return
        seen = (meta["resourceVersion"], meta.get("generation"), bool(meta.get("deletionTimestamp")))
        with self._guard:
            if len(self._versions) > MAX_REMEMBERED:
                self._versions.clear()
            self._versions[meta["uid"]] = seen

    @contextmanager
    def turn(self, namespace: str, model: str, received: float | None) -> Iterator[bool]:
        """One reconcile of a model at a time. Yields False when a reconcile that began after `received`
        (time.monotonic() when the trigger arrived) has succeeded meanwhile: it read the world after this
        trigger's change, so nothing is left to do. A reconcile that raises does not count. `received`
        None: work other than a reconcile (a rollout step), which always runs and covers nothing."""
        key = (namespace, model)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if received is not None and self._done.get(key, -math.inf) > received:
                yield False
                return
            started = time.monotonic()
            yield True
            if received is not None:
                self._done[key] = started

    def since_reconciled(self, namespace: str, model: str) -> float:
        """Seconds since the last successful reconcile of the model began (inf if none did)."""
        return time.monotonic() - self._done.get((namespace, model), -math.inf)
