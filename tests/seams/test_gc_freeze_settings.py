"""MODELFLEET_GC_FREEZE to the running server: by default the server keeps what it holds once started and
once its version has loaded (here a CPU engine's thread, with the model, in the server's own process) out
of the garbage collector's full passes (dataplane/heap.py); `false` leaves the collector as Python has
it. The server runs in this process, so its collector's state is read here."""

from __future__ import annotations

import gc

import httpx
import pytest
import yaml
from modelfleet.dataplane.manifest import single_model_manifest
from modelfleet.dataplane.server.settings import ServerSettings


@pytest.fixture()
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize(("value", "frozen"), [(None, True), ("false", False)])
def test_the_servers_heap_is_frozen_unless_the_setting_says_no(
    value, frozen, tiny_model_dir, tmp_path, monkeypatch, run_server, unfrozen
):
    monkeypatch.delenv("MODELFLEET_GC_FREEZE", raising=False)
    if value is not None:
        monkeypatch.setenv("MODELFLEET_GC_FREEZE", value)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump(single_model_manifest(tiny_model_dir, name="tiny").model_dump()))
    server = run_server(ServerSettings(), manifest)
    engine = next(engine for _, _, engine in server.dataplane.loaded_engines())
    # The engine, loaded after the start's freeze, is frozen with what it holds: no collection sees it.
    assert (gc.get_freeze_count() > 0) is frozen
    assert any(obj is engine for obj in gc.get_objects()) is not frozen
    answer = httpx.post(
        f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert answer.status_code == 200, answer.text
