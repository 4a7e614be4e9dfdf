"""The model manager with an injected loader: one load per version, LRU and idle unloading, failures."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest
from modelfleet.dataplane.server.errors import ModelNotFound, ModelUnavailable
from modelfleet.dataplane.server.model_manager import LoadState, ModelManager, VersionSpec


class FakeEngine(dict):
    """What the manager needs of an engine: whether it has died, and a hook it calls when it does."""

    failure: str | None = None
    on_failure = None


class Loads:
    """A loader that records its calls; `fail` makes a version's load raise."""

    def __init__(self, delay: float = 0.05, fail: set[str] = frozenset()) -> None:
        self.delay = delay
        self.fail = fail
        self.calls: list[str] = []
        self.closed: list[str] = []
        self._lock = threading.Lock()

    def load(self, spec: VersionSpec) -> dict:
        with self._lock:
            self.calls.append(spec.version)
        time.sleep(self.delay)
        if spec.version in self.fail:
            raise OSError(f"cannot open {spec.artifact}/model.safetensors\nsecond line")
        return FakeEngine(version=spec.version)

    def close(self, engine: dict) -> None:
        self.closed.append(engine["version"])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spec(version: str, *, preload: bool = False, artifact: str | None = None) -> VersionSpec:
    return VersionSpec(model="m", version=version, artifact=artifact or f"/w/{version}", preload=preload)


def manager(loads: Loads, **kwargs) -> ModelManager:
    return ModelManager(loads.load, estimate_bytes=lambda s: 100, close=loads.close, **kwargs)


async def use(mgr: ModelManager, version: str, hold: float = 0.0) -> dict:
    async with mgr.lease("m", version) as slot:
        await asyncio.sleep(hold)
        return slot.engine


async def test_concurrent_first_requests_cause_one_load():
    loads = Loads(delay=0.2)
    mgr = manager(loads)
    mgr.sync([spec("v1")])
    engines = await asyncio.gather(*(use(mgr, "v1") for _ in range(20)))
    assert loads.calls == ["v1"]
    assert all(e is engines[0] for e in engines)
    assert mgr.slots[("m", "v1")].in_flight == 0
    await mgr.close()


async def test_an_engine_that_died_is_loaded_again_once_by_the_next_requests():
    made, closed = [], []

    def load(spec: VersionSpec) -> types.SimpleNamespace:
        time.sleep(0.05)
        made.append(types.SimpleNamespace(failure=None))
        return made[-1]

    mgr = ModelManager(load, estimate_bytes=lambda s: 100, close=closed.append)
    mgr.sync([spec("v1")])
    first = await use(mgr, "v1")
    first.failure = "the engine process exited (code -9)"
    engines = await asyncio.gather(*(use(mgr, "v1") for _ in range(5)))
    assert len(made) == 2 and all(e is made[1] for e in engines)
    assert closed == [first] and mgr.slots[("m", "v1")].state is LoadState.LOADED
    await mgr.close()


async def test_preload_at_sync_and_ready():
    loads = Loads()
    mgr = manager(loads)
    mgr.sync([spec("v1", preload=True), spec("v2")])
    assert not mgr.ready()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if mgr.ready():
            break
    assert mgr.ready()
    assert loads.calls == ["v1"]  # v2 stays lazy
    await mgr.close()


class DyingEngine:
    """An engine with a process of its own, which can die: it then calls its owner's hook from its
    own thread, as AsyncLLMProcess's reader thread does."""

    failure: str | None = None
    on_failure = None

    def die(self) -> None:
        self.failure = "the engine process exited (code -9)"
        threading.Thread(target=self.on_failure, args=(self.failure,)).start()


async def test_a_dead_engine_is_unloaded_at_once_and_a_preloaded_version_loads_again():
    made: list[tuple[str, DyingEngine]] = []

    def load(spec: VersionSpec) -> DyingEngine:
        time.sleep(0.02)
        made.append((spec.version, DyingEngine()))
        return made[-1][1]

    mgr = ModelManager(load, estimate_bytes=lambda s: 100, close=lambda engine: None)
    mgr.sync([spec("pre", preload=True), spec("lazy")])
    await use(mgr, "lazy")
    while not mgr.ready():
        await asyncio.sleep(0.01)
    pre, lazy = (mgr.slots[("m", v)] for v in ("pre", "lazy"))
    dead = (pre.engine, lazy.engine)
    for engine in dead:
        engine.die()
    for _ in range(300):
        await asyncio.sleep(0.01)
        if pre.engine not in (None, dead[0]) and pre.state is LoadState.LOADED:
            break
    assert pre.state is LoadState.LOADED and pre.engine is not dead[0] and mgr.ready()  # no request needed
    assert lazy.state is LoadState.UNLOADED and lazy.engine is None  # loads on its next request
    assert sorted(v for v, _ in made) == ["lazy", "pre", "pre"]
    await mgr.close()


async def test_lru_unload_under_budget_never_touches_busy_versions():
    loads = Loads(delay=0.01)
    clock = Clock()
    mgr = manager(loads, memory_budget_bytes=200, clock=clock)
    mgr.sync([spec("v1"), spec("v2"), spec("v3")])
    await use(mgr, "v1")
    clock.now = 1
    await use(mgr, "v2")
    clock.now = 2
    await use(mgr, "v1")  # v1 now more recent than v2
    clock.now = 3
    await use(mgr, "v3")  # budget fits two: the least recently used (v2) goes
    states = {v: mgr.slots[("m", v)].state for v in ("v1", "v2", "v3")}
    assert states == {"v1": LoadState.LOADED, "v2": LoadState.UNLOADED, "v3": LoadState.LOADED}
    assert loads.closed == ["v2"]

    # Both loaded versions busy: loading v2 cannot make room and says why (503), nothing is unloaded.
    hold1 = asyncio.create_task(use(mgr, "v1", hold=0.3))
    hold3 = asyncio.create_task(use(mgr, "v3", hold=0.3))
    await asyncio.sleep(0.05)
    with pytest.raises(ModelUnavailable, match="memory budget full") as info:
        await use(mgr, "v2")
    assert info.value.status == 503
    assert loads.closed == ["v2"]
    await asyncio.gather(hold1, hold3)
    mgr.load_retry_seconds = 0
    await use(mgr, "v2")  # once idle again, v2 loads by unloading the LRU one
    assert mgr.slots[("m", "v2")].state is LoadState.LOADED
    await mgr.close()


async def test_idle_versions_unload_after_the_configured_time():
    loads = Loads(delay=0.0)
    clock = Clock()
    mgr = manager(loads, idle_unload_seconds=10, clock=clock)
    mgr.sync([spec("v1"), spec("v2", preload=True)])
    await use(mgr, "v1")
    await use(mgr, "v2")
    clock.now = 5
    assert await mgr.unload_idle() == []
    clock.now = 11
    assert await mgr.unload_idle() == ["m@v1"]  # preloaded versions stay
    assert mgr.slots[("m", "v1")].state is LoadState.UNLOADED
    await use(mgr, "v1")  # and load again on the next request
    assert loads.calls.count("v1") == 2
    await mgr.close()


async def test_idle_reaper_runs_in_background():
    loads = Loads(delay=0.0)
    mgr = manager(loads, idle_unload_seconds=0.2)
    mgr.start()
    mgr.sync([spec("v1")])
    await use(mgr, "v1")
    await asyncio.sleep(0.5)
    assert mgr.slots[("m", "v1")].state is LoadState.UNLOADED
    await mgr.close()


async def test_load_failure_is_503_with_reason_and_others_serve():
    loads = Loads(fail={"bad"})
    mgr = manager(loads, load_retry_seconds=60)
    mgr.sync([spec("good"), spec("bad")])
    results = await asyncio.gather(*(use(mgr, "bad") for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, ModelUnavailable) for r in results)
    assert "failed to load: OSError: cannot open /w/bad/model.safetensors" in str(results[0])
    assert "second line" not in str(results[0])
    assert loads.calls == ["bad"]  # one load for all five, and no retry within load_retry_seconds
    with pytest.raises(ModelUnavailable):
        await use(mgr, "bad")
    assert loads.calls == ["bad"]
    assert (await use(mgr, "good")) == {"version": "good"}
    detail = {d["version"]: d for d in mgr.details()}
    assert detail["bad"]["state"] == "failed" and "cannot open" in detail["bad"]["error"]
    await mgr.close()


async def test_unknown_version_is_not_found():
    mgr = manager(Loads())
    with pytest.raises(ModelNotFound):
        await use(mgr, "v9")


async def test_removed_version_unloads_only_after_its_requests_end():
    loads = Loads(delay=0.0)
    mgr = manager(loads)
    mgr.sync([spec("v1"), spec("v2")])
    await use(mgr, "v2")
    holder = asyncio.create_task(use(mgr, "v1", hold=0.2))
    await asyncio.sleep(0.05)
    mgr.sync([spec("v2")])  # v1 removed while in flight
    assert ("m", "v1") not in mgr.slots
    await asyncio.sleep(0)
    assert loads.closed == []
    assert (await holder) == {"version": "v1"}  # the request finishes on the old engine
    await asyncio.sleep(0.05)
    assert loads.closed == ["v1"]
    await mgr.close()


async def test_changed_artifact_loads_a_new_engine():
    loads = Loads(delay=0.0)
    mgr = manager(loads)
    mgr.sync([spec("v1")])
    await use(mgr, "v1")
    mgr.sync([spec("v1")])  # unchanged: nothing happens
    await asyncio.sleep(0.01)
    assert loads.closed == []
    mgr.sync([spec("v1", artifact="/w/v1-fixed")])
    await use(mgr, "v1")
    await asyncio.sleep(0.01)
    assert loads.calls == ["v1", "v1"] and loads.closed == ["v1"]
    await mgr.close()


class CyclicEngine(FakeEngine):
    """An engine that holds itself (threads and callbacks do): only the garbage collector frees it."""

    def __init__(self, version: str) -> None:
        super().__init__(version=version)
        self.me = self


async def test_with_freeze_heap_a_loaded_engine_is_frozen_and_freed_on_unload():
    import gc
    import weakref

    gc.unfreeze()
    made: list[weakref.ref] = []

    def load(spec: VersionSpec) -> CyclicEngine:
        engine = CyclicEngine(spec.version)
        made.append(weakref.ref(engine))
        return engine

    clock = Clock()
    mgr = ModelManager(
        load, estimate_bytes=lambda s: 100, close=lambda engine: None, idle_unload_seconds=10,
        clock=clock, freeze_heap=True,
    )  # fmt: skip
    try:
        mgr.sync([spec("v1")])
        await use(mgr, "v1")
        assert gc.get_freeze_count() > 0 and made[0]() is not None
        clock.now = 11
        assert await mgr.unload_idle() == ["m@v1"]
        assert made[0]() is None, "the unloaded engine's cycle was frozen and never collected"
    finally:
        await mgr.close()
        gc.unfreeze()
