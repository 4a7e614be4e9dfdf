"""LRU and idle unloading with real engines: a memory budget that holds one tiny version at a time."""

from __future__ import annotations

import time

import openai
import pytest
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.server.loading import estimate_engine_bytes
from modelfleet.dataplane.server.model_manager import VersionSpec
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import LiveServer, model_yaml


@pytest.fixture(scope="module")
def budgeted(tiny_model_dir, tiny_model_v2_dir):
    manifest = ServingManifest.from_yaml(
        "models:\n"
        + model_yaml(
            "tiny",
            f'{{name: v1, weight: 50, artifact: "{tiny_model_dir}"}}',
            f'{{name: v2, weight: 50, artifact: "{tiny_model_v2_dir}"}}',
        )
    )
    one = estimate_engine_bytes(
        VersionSpec("tiny", "v1", str(tiny_model_dir), (("kv_cache_bytes", "8000000"),))
    )
    settings = ServerSettings(memory_budget_bytes=int(one * 1.5), idle_unload_seconds=1.0)
    server = LiveServer(settings, manifest).start()
    yield server
    server.stop()


def states(server) -> dict[str, str]:
    return {version: slot.state.value for (_, version), slot in server.dataplane.manager.slots.items()}


def test_budget_unloads_the_idle_version_then_idle_time_unloads_the_rest(budgeted):
    client = openai.OpenAI(base_url=f"{budgeted.url}/v1", api_key="x", max_retries=0, timeout=60)
    assert states(budgeted) == {"v1": "unloaded", "v2": "unloaded"}
    client.completions.create(model="tiny@v1", prompt="x", max_tokens=2)
    assert states(budgeted) == {"v1": "loaded", "v2": "unloaded"}
    v1_engine = budgeted.engine("tiny", "v1")
    client.completions.create(model="tiny@v2", prompt="x", max_tokens=2)
    assert states(budgeted) == {"v1": "unloaded", "v2": "loaded"}
    assert not v1_engine._thread.is_alive()  # the unloaded engine really stopped
    deadline = time.monotonic() + 10
    while states(budgeted)["v2"] != "unloaded":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.completions.create(model="tiny@v1", prompt="x", max_tokens=2).choices  # loads again
