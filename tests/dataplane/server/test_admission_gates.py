"""Admission per version: sized from the engine, capped by MODELFLEET_MAX_RUNNING, one bound on waiting."""

from __future__ import annotations

import asyncio

import pytest
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.server.admission import Admission, AdmissionQueue
from modelfleet.dataplane.server.errors import RateLimited
from modelfleet.dataplane.server.loading import spec_max_num_seqs
from modelfleet.dataplane.server.model_manager import VersionSpec


async def hold(gate: AdmissionQueue, release: asyncio.Event) -> None:
    async with gate.admit():
        await release.wait()


async def test_each_version_admits_its_engines_size_and_waiting_is_bounded_server_wide():
    admission = Admission(max_waiting=2)
    a, b = admission.gate("m", "a", 2), admission.gate("m", "b", 1)
    assert (a.max_running, b.max_running) == (2, 1)
    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(gate, release)) for gate in (a, a, a, b, b)]
    await asyncio.sleep(0)
    assert (admission.running, admission.waiting) == (3, 2)
    assert admission.waiting_by_version() == {("m", "a"): 1, ("m", "b"): 1}
    with pytest.raises(RateLimited, match="queue limit 2"):
        async with b.admit():
            pass
    release.set()
    await asyncio.gather(*tasks)
    assert (admission.running, admission.waiting) == (0, 0)


async def test_max_running_caps_below_the_engine_and_a_resized_engine_gets_a_new_gate():
    admission = Admission(max_waiting=4, cap=2)
    assert admission.gate("m", "v", 8).max_running == 2
    assert admission.gate("m", "v", 1).max_running == 1
    uncapped = Admission(max_waiting=4)
    old = uncapped.gate("m", "v", 1)
    release = asyncio.Event()
    task = asyncio.create_task(hold(old, release))
    waiter = asyncio.create_task(hold(old, release))
    await asyncio.sleep(0)
    new = uncapped.gate("m", "v", 3)
    assert new is not old and new.max_running == 3
    # Requests of the replaced gate still count until they end.
    assert (uncapped.running, uncapped.waiting_by_version()) == (1, {("m", "v"): 1})
    release.set()
    await asyncio.gather(task, waiter)
    assert uncapped.running == 0


def test_before_its_engine_is_built_a_versions_size_comes_from_its_settings():
    spec = VersionSpec("m", "v", "/a", engine_config=(("max_num_seqs", "5"),))
    assert spec_max_num_seqs(spec) == 5
    assert spec_max_num_seqs(VersionSpec("m", "v", "/a")) == EngineConfig.max_num_seqs


def test_a_gate_needs_room_for_one_request():
    with pytest.raises(ValueError, match="max_running: 0"):
        AdmissionQueue(0, 1)
