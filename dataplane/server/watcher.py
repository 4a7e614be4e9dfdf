"""Watch the manifest file and apply changes in place.

Polling the file's content (not inotify) works the same on every file system and with Kubernetes
ConfigMap volumes, which swap a symlink rather than writing the file. A change is applied once two
checks in a row read the same content, so a file caught half-written by an editor (or truncated to zero
bytes, or left blank, before the rewrite) is never applied. A bad manifest is logged and counted; the
server keeps serving the last good one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from modelfleet.dataplane.manifest import ManifestError, ServingManifest, load_manifest

log = logging.getLogger("modelfleet.server")


def _digest(path: Path) -> str | None:
    """The content's digest; None for an unreadable or blank file (a rewrite in progress). A blank file
    would parse as a manifest without models and unload them all; `models: []` says that on purpose."""
    try:
        content = path.read_bytes()
    except OSError:
        return None
    return hashlib.sha256(content).hexdigest() if content.strip() else None


class ManifestWatcher:
    def __init__(
        self,
        path: Path,
        apply: Callable[[ServingManifest], None],
        *,
        interval: float = 1.0,
        on_result: Callable[[str], None] = lambda result: None,
    ) -> None:
        self.path = path
        self.apply = apply
        self.interval = interval
        self.on_result = on_result
        self._seen = _digest(path)
        self._pending: str | None = None  # a changed digest, applied when the next check reads it again
        self._task: asyncio.Task | None = None

    def check(self) -> bool:
        """Apply the file if it changed and has stayed the same since the last check; True when a new
        manifest was applied."""
        digest = _digest(self.path)
        if digest is None or digest == self._seen:
            self._pending = None
            return False
        if digest != self._pending:
            self._pending = digest
            return False
        self._seen, self._pending = digest, None
        try:
            manifest = load_manifest(self.path)
        except ManifestError as exc:
            log.error("%s; still serving the previous manifest", exc)
            self.on_result("invalid")
            return False
        self.apply(manifest)
        self.on_result("applied")
        log.info("applied the changed manifest %s", self.path)
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.check()
            except Exception:  # never let a surprise stop the watching
                log.exception("manifest check failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
