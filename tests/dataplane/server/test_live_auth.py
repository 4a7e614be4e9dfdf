"""API keys, per-key limits and the bounded queue on a live server (real engine, tiny demo model)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from modelfleet.dataplane.manifest import single_model_manifest
from modelfleet.dataplane.server.auth import hash_key
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import TEST_ENGINE, LiveServer


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps(
            [
                {"sha256": hash_key("sk-free"), "name": "free"},
                {"sha256": hash_key("sk-one"), "name": "one-at-a-time", "max_concurrent": 1},
                {"sha256": hash_key("sk-small"), "name": "small", "tokens_per_minute": 20},
            ]
        )
    )
    manifest = single_model_manifest(tiny_model_dir, name="tiny")
    manifest.models[0].engine.update(TEST_ENGINE)
    settings = ServerSettings(api_key_file=keys, max_running=1, max_waiting=1)
    server = LiveServer(settings, manifest).start()
    server.wait_ready()
    yield server
    server.stop()


def client(server, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "", max_retries=0, timeout=60)


def long_stream(server, key: str, started: threading.Event, done: threading.Event) -> None:
    body = {"model": "tiny", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        for _ in r.iter_lines():
            started.set()
    done.set()


def test_keys_are_required(guarded):
    with pytest.raises(openai.AuthenticationError) as info:
        client(guarded, "sk-wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert info.value.body["message"] == "invalid API key"
    missing = httpx.post(f"{guarded.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert client(guarded, "sk-free").completions.create(model="tiny", prompt="x", max_tokens=1).choices
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes need no key
    metrics = httpx.get(f"{guarded.url}/metrics").text
    assert 'modelfleet_requests_total{model="_unknown",status="401",version=""} 2.0' in metrics


def test_concurrency_cap_and_bounded_queue(guarded):
    started, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=long_stream, args=(guarded, "sk-one", started, done))
    worker.start()
    try:
        assert started.wait(30)
        with pytest.raises(openai.RateLimitError) as info:
            client(guarded, "sk-one").completions.create(model="tiny", prompt="x", max_tokens=1)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "concurrency_limit_exceeded"
        # max_running=1 is taken by that stream; one more request may wait, a third is refused at once.
        waiting_started, waiting_done = threading.Event(), threading.Event()
        waiter = threading.Thread(
            target=long_stream, args=(guarded, "sk-free", waiting_started, waiting_done)
        )
        waiter.start()
        deadline = time.monotonic() + 10
        while guarded.dataplane.admission.waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            client(guarded, "sk-free").completions.create(model="tiny", prompt="x", max_tokens=1)
        assert info.value.body["code"] == "queue_full"
    finally:
        worker.join(60)
    waiter.join(60)
    assert waiting_done.is_set()  # the queued request was served, not dropped
    assert client(guarded, "sk-one").completions.create(model="tiny", prompt="x", max_tokens=1).choices


def test_token_rate_limit(guarded):
    small = client(guarded, "sk-small")
    small.completions.create(
        model="tiny", prompt="count to ten", max_tokens=12, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.RateLimitError) as info:
        small.completions.create(model="tiny", prompt="x", max_tokens=1)
    retry_after = int(info.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 120
    assert "20 tokens per minute" in info.value.body["message"]


def test_websocket_needs_a_key(guarded):
    from websockets.sync.client import connect

    url = guarded.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url) as socket:
        message = json.loads(socket.recv(timeout=10))
        assert message["type"] == "error" and message["error"]["code"] == "invalid_api_key"
    with connect(url + "?api_key=sk-free") as socket:
        socket.send(json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}))
        assert json.loads(socket.recv(timeout=30))["type"] == "start"
