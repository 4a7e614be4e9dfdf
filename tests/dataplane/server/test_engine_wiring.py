"""The server's wiring to its engines: limits read from `Engine.limits`, each request counted once."""

from __future__ import annotations

import httpx
from modelfleet.dataplane.engine.protocol import EngineLimits
from modelfleet.dataplane.manifest import single_model_manifest
from modelfleet.dataplane.server.app import create_app
from modelfleet.dataplane.server.runtime import build_dataplane
from modelfleet.dataplane.server.settings import ServerSettings

from .test_dataplane import POISON, ScriptedEngine


class SmallEngine(ScriptedEngine):
    limits = EngineLimits(max_num_seqs=3, max_model_len=20, vocab_size=50)


async def test_readiness_and_admission_take_the_engines_own_limits():
    engine = SmallEngine()
    # The manifest says otherwise: what the built engine runs with wins.
    manifest = single_model_manifest("/models/m", name="m")
    manifest.models[0].engine["max_num_seqs"] = 99
    dp = build_dataplane(ServerSettings(), loader=lambda spec: engine, estimate_bytes=lambda spec: 0)
    dp.apply_manifest(manifest)
    try:
        transport = httpx.ASGITransport(app=create_app(dp))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            too_long = await http.post("/v1/completions", json={"model": "m", "prompt": [1] * 20})
            ok = await http.post("/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 1})
            ready = (await http.get("/ready")).json()
        assert too_long.status_code == 400 and "19" in too_long.json()["error"]["message"]
        assert ok.status_code == 200
        (version,) = ready["versions"]
        assert (version["max_num_seqs"], version["max_model_len"]) == (3, 20)
        assert version["admission_limit"] == 3
    finally:
        await dp.close()


async def test_an_engine_failure_in_a_whole_answer_is_counted_once_under_its_version():
    engine = ScriptedEngine()
    dp = build_dataplane(ServerSettings(), loader=lambda spec: engine, estimate_bytes=lambda spec: 0)
    dp.apply_manifest(single_model_manifest("/models/m", name="m"))
    try:
        transport = httpx.ASGITransport(app=create_app(dp))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            body = {"model": "m", "prompt": [1, POISON], "max_tokens": 5}
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 500
        get = dp.metrics.registry.get_sample_value
        total = "modelfleet_requests_total"
        assert get(total, {"model": "m", "version": "v1", "status": "500"}) == 1.0
        assert get(total, {"model": "_unknown", "version": "", "status": "500"}) is None
    finally:
        await dp.close()
