"""Which model versions are loaded: lazy loads (exactly one per version however many requests wait),
preloads, LRU unloading under a memory budget, idle unloading, and failed loads reported with a reason.

The loader is injected (the server passes one that builds an `AsyncLLM`), so this logic is tested
without an engine. A version with requests in flight is never unloaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from modelfleet.dataplane import heap
from modelfleet.dataplane.engine.protocol import Engine
from modelfleet.dataplane.server.errors import ModelNotFound, ModelUnavailable

log = logging.getLogger("modelfleet.server")


class LoadState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


@dataclass(frozen=True)
class VersionSpec:
    """What identifies a loaded version: changing the artifact or engine settings means a new load."""

    model: str
    version: str
    artifact: str
    engine_config: tuple[tuple[str, Any], ...] = ()
    preload: bool = False

    @property
    def label(self) -> str:
        return f"{self.model}@{self.version}"


@dataclass(eq=False)
class VersionSlot:
    spec: VersionSpec
    state: LoadState = LoadState.UNLOADED
    engine: Engine | None = None
    size_bytes: int = 0
    in_flight: int = 0
    last_used: float = 0.0
    error: str | None = None
    failed_at: float = 0.0
    load_seconds: float | None = None
    retired: bool = False
    load_task: asyncio.Task | None = field(default=None, repr=False)

    def detail(self) -> dict[str, Any]:
        return {
            "model": self.spec.model,
            "version": self.spec.version,
            "state": self.state.value,
            "preload": self.spec.preload,
            "in_flight": self.in_flight,
            "size_bytes": self.size_bytes,
            "load_seconds": self.load_seconds,
            "error": self.error,
        }


Loader = Callable[[VersionSpec], Engine]  # blocking
SizeEstimator = Callable[[VersionSpec], int]
Closer = Callable[[Engine], None]
StateListener = Callable[[VersionSlot], None]


class ModelManager:
    def __init__(
        self,
        loader: Loader,
        *,
        estimate_bytes: SizeEstimator,
        close: Closer,
        memory_budget_bytes: int = 0,
        idle_unload_seconds: float = 0.0,
        load_retry_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_state: StateListener | None = None,
        on_loaded: Callable[[VersionSlot, float], None] | None = None,
        freeze_heap: bool = False,
    ) -> None:
        """`freeze_heap`: each loaded engine's objects are kept out of the collector's full passes, and
        an unload collects once over everything (dataplane/heap.py)."""
        self.loader = loader
        self.freeze_heap = freeze_heap
        self.estimate_bytes = estimate_bytes
        self.close_engine = close
        self.memory_budget_bytes = memory_budget_bytes
        self.idle_unload_seconds = idle_unload_seconds
        self.load_retry_seconds = load_retry_seconds
        self.clock = clock
        self.on_state = on_state or (lambda slot: None)
        self.on_loaded = on_loaded or (lambda slot, seconds: None)
        self.slots: dict[tuple[str, str], VersionSlot] = {}
        self._retired: list[VersionSlot] = []
        self._background: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None

    # -- manifest changes ---------------------------------------------------------------------------

    def sync(self, specs: list[VersionSpec]) -> None:
        """Make the slots match the manifest; retire removed or changed versions once they are idle."""
        wanted = {(s.model, s.version): s for s in specs}
        for key, slot in list(self.slots.items()):
            if wanted.get(key) != slot.spec:
                del self.slots[key]
                self._retire(slot)
        for key, spec in wanted.items():
            if key not in self.slots:
                self.slots[key] = slot = VersionSlot(spec=spec)
                self.on_state(slot)
                if spec.preload:
                    self._spawn(self._preload(slot))

    def _retire(self, slot: VersionSlot) -> None:
        slot.retired = True
        if slot.in_flight == 0:
            self._spawn(self._unload(slot))
        else:
            self._retired.append(slot)  # unloaded by the last lease that releases it

    async def _preload(self, slot: VersionSlot) -> None:
        with suppress(ModelUnavailable):
            await self._ensure_loaded(slot)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- leases --------------------------------------------------------------------------------------

    @asynccontextmanager
    async def lease(self, model: str, version: str) -> AsyncIterator[VersionSlot]:
        """The loaded version for one request; loads it first if needed. Never unloaded while held."""
        slot = self.slots.get((model, version))
        if slot is None:
            raise ModelNotFound(f"model '{model}@{version}' is not served here")
        slot.in_flight += 1
        slot.last_used = self.clock()
        try:
            await self._ensure_loaded(slot)
            yield slot
        finally:
            slot.in_flight -= 1
            slot.last_used = self.clock()
            if slot.retired and slot.in_flight == 0 and slot in self._retired:
                self._retired.remove(slot)
                self._spawn(self._unload(slot))

    async def _ensure_loaded(self, slot: VersionSlot) -> None:
        if slot.state is LoadState.LOADED and slot.engine is not None and slot.engine.failure is None:
            return
        # An engine that died before its failure hook ran is found here: this request loads it again.
        await self._unload_if_dead(slot)
        if slot.state is LoadState.FAILED and self.clock() - slot.failed_at < self.load_retry_seconds:
            raise ModelUnavailable(
                f"version '{slot.spec.label}' failed to load: {slot.error}", code="model_load_failed"
            )
        if slot.load_task is None or slot.load_task.done():
            slot.load_task = asyncio.get_running_loop().create_task(self._load(slot))
        # Shield: one waiter giving up (client gone) must not cancel the load the others wait for.
        await asyncio.shield(slot.load_task)
        if slot.state is not LoadState.LOADED:
            raise ModelUnavailable(
                f"version '{slot.spec.label}' failed to load: {slot.error}", code="model_load_failed"
            )

    async def _load(self, slot: VersionSlot) -> None:
        need = self.estimate_bytes(slot.spec)
        try:
            await self._make_room(slot, need)
        except ModelUnavailable as exc:
            self._fail(slot, exc.message)
            return
        slot.state, slot.size_bytes, slot.error = LoadState.LOADING, need, None
        self.on_state(slot)
        started = time.perf_counter()
        try:
            engine = await asyncio.to_thread(self.loader, slot.spec)
        except Exception as exc:  # any loader failure becomes the version's reason, never a crash
            reason = (str(exc).strip().splitlines() or [""])[0]
            self._fail(slot, f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__)
            log.error("loading %s failed: %s", slot.spec.label, slot.error)
            return
        seconds = time.perf_counter() - started
        # An engine can die under us (its process, a tensor-parallel rank): it then calls this.
        loop = asyncio.get_running_loop()

        def failed(reason: str) -> None:
            loop.call_soon_threadsafe(self._engine_failed, slot, engine)

        engine.on_failure = failed
        slot.engine, slot.state, slot.load_seconds = engine, LoadState.LOADED, seconds
        slot.last_used = self.clock()
        self.on_state(slot)
        self.on_loaded(slot, seconds)
        if self.freeze_heap:
            heap.freeze()
        log.info("loaded %s in %.2f s", slot.spec.label, seconds)
        if slot.retired and slot.in_flight == 0:
            await self._unload(slot)

    def _engine_failed(self, slot: VersionSlot, engine: Engine) -> None:
        """A loaded engine died: unload it now, and load a preloaded version again at once (others load
        on their next request), so that readiness tells the truth meanwhile."""
        if slot.engine is engine:
            self._spawn(self._restart(slot))

    async def _restart(self, slot: VersionSlot) -> None:
        await self._unload_if_dead(slot)
        if slot.spec.preload and not slot.retired:
            await self._preload(slot)

    async def _unload_if_dead(self, slot: VersionSlot) -> None:
        engine = slot.engine if slot.state is LoadState.LOADED else None
        if engine is not None and engine.failure is not None:
            log.error("%s can no longer serve: %s; unloading it", slot.spec.label, engine.failure)
            await self._unload(slot)

    def _fail(self, slot: VersionSlot, reason: str) -> None:
        slot.state, slot.error, slot.failed_at, slot.size_bytes = LoadState.FAILED, reason, self.clock(), 0
        self.on_state(slot)

    def _resident(self) -> list[VersionSlot]:
        live = [*self.slots.values(), *self._retired]
        return [s for s in live if s.state in (LoadState.LOADED, LoadState.LOADING)]

    async def _make_room(self, slot: VersionSlot, need: int) -> None:
        """Unload least recently used idle versions until `need` more bytes fit the budget."""
        budget = self.memory_budget_bytes
        if not budget:
            return
        if need > budget:
            raise ModelUnavailable(
                f"version '{slot.spec.label}' needs {need} bytes, more than the whole memory budget "
                f"({budget} bytes); raise MODELFLEET_MEMORY_BUDGET_BYTES",
                code="memory_budget_exceeded",
            )
        resident = self._resident()
        used = sum(s.size_bytes for s in resident)
        idle = sorted(
            (s for s in resident if s.state is LoadState.LOADED and s.in_flight == 0 and not s.spec.preload),
            key=lambda s: s.last_used,
        )
        while used + need > budget and idle:
            victim = idle.pop(0)
            used -= victim.size_bytes
            log.info("unloading %s to make room for %s", victim.spec.label, slot.spec.label)
            await self._unload(victim)
        if used + need > budget:
            busy = ", ".join(f"{s.spec.label} ({s.state.value}, {s.in_flight} in flight)" for s in resident)
            raise ModelUnavailable(
                f"memory budget full: loading '{slot.spec.label}' ({need} bytes) needs an idle version to "
                f"unload, but all are busy or preloaded: {busy}; retry shortly",
                code="memory_budget_full",
                retry_after=1.0,
            )

    async def _unload(self, slot: VersionSlot) -> None:
        engine = slot.engine
        slot.engine, slot.state, slot.size_bytes = None, LoadState.UNLOADED, 0
        self.on_state(slot)
        if engine is not None:
            await asyncio.to_thread(self.close_engine, engine)
            del engine
            if self.freeze_heap:  # what the engine left in cycles was frozen with it
                heap.reclaim()

    # -- idle unloading ------------------------------------------------------------------------------

    async def unload_idle(self) -> list[str]:
        """Unload versions idle for longer than `idle_unload_seconds`; returns their labels."""
        if not self.idle_unload_seconds:
            return []
        now = self.clock()
        done = []
        for slot in list(self.slots.values()):
            idle = slot.state is LoadState.LOADED and slot.in_flight == 0 and not slot.spec.preload
            if idle and now - slot.last_used >= self.idle_unload_seconds:
                await self._unload(slot)
                done.append(slot.spec.label)
        return done

    def start(self) -> None:
        if self.idle_unload_seconds and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        period = min(1.0, self.idle_unload_seconds / 4)
        while True:
            await asyncio.sleep(period)
            for label in await self.unload_idle():
                log.info("unloaded %s after %.0f s idle", label, self.idle_unload_seconds)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with suppress(asyncio.CancelledError):
                await self._reaper
        for task in list(self._background):
            with suppress(Exception, asyncio.CancelledError):
                await task
        for slot in [*self.slots.values(), *self._retired]:
            if slot.load_task is not None and not slot.load_task.done():
                with suppress(Exception, asyncio.CancelledError):
                    await slot.load_task
            await self._unload(slot)

    # -- reporting -----------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Every preload version is loaded."""
        return all(s.state is LoadState.LOADED for s in self.slots.values() if s.spec.preload)

    def details(self) -> list[dict[str, Any]]:
        return [slot.detail() for slot in self.slots.values()]
