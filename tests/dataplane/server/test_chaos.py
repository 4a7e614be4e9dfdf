"""Chaos under load: 50 streams on a server whose engine runs in its own process (as on a GPU), while the
engine process is killed, the manifest is rewritten to another version, and some clients walk away.

Every request the server accepted must end in a way its client can see (a finished stream, an error
event, or an error status), none may hang, and afterwards nothing is held: admission places, waiting
counts, engine sequences and KV blocks all back to idle.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import engine_process_server, one_version_yaml
from .guarded import GuardedServer

STREAMS = 50
WALK_AWAY = 8


@pytest.fixture()
def server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[GuardedServer]:
    settings = ServerSettings(manifest_poll_seconds=0.1, send_timeout_seconds=2, max_tokens_limit=2000)
    path = tmp_path / "manifest.yaml"
    with engine_process_server(
        settings, tiny_model_dir, manifest_path=path, server_class=GuardedServer
    ) as live:
        yield live


class Client(threading.Thread):
    """One streamed completion; `outcome` says how it ended."""

    def __init__(self, url: str, walk_away: bool, rng: random.Random, max_tokens: int = 120) -> None:
        super().__init__(daemon=True)
        self.url, self.walk_away = url, walk_away
        self.max_tokens = rng.randint(max_tokens // 6, max_tokens)
        self.outcome = "running"
        self.detail = ""
        self.chunks = 0  # token chunks read so far

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as answer:
                if answer.status_code != 200:
                    answer.read()
                    self.outcome = f"status {answer.status_code}"
                    self.detail = answer.text[:200]
                    return
                self.outcome = self._read(answer.iter_lines())
        except httpx.HTTPError as exc:
            self.outcome, self.detail = "transport error", repr(exc)

    def _read(self, lines) -> str:
        finished, error, chunks = False, None, 0
        for line in lines:
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return "error event" if error else ("completed" if finished else "lost: [DONE] unfinished")
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                self.detail = error["message"]
                continue
            chunks += 1
            self.chunks = chunks
            finished = finished or any(c.get("finish_reason") for c in event["choices"])
            if self.walk_away and chunks == 3:
                return "walked away"
        return "lost: stream ended without [DONE]"


def settled(live: GuardedServer) -> tuple[bool, str]:
    admission = live.dataplane.admission
    state = {"admission running": admission.running, "admission waiting": admission.waiting}
    for model, version, engine in live.dataplane.loaded_engines():
        stats = engine.stats()
        state[f"{model}@{version}"] = (stats.num_running, stats.num_waiting, stats.kv_cache_usage)
    idle = state["admission running"] == state["admission waiting"] == 0 and all(
        value == (0, 0, 0.0) for key, value in state.items() if "@" in key
    )
    return idle, str(state)


def test_streams_survive_an_engine_kill_a_manifest_change_and_clients_leaving(
    server: GuardedServer, tiny_model_v2_dir: Path
):
    rng = random.Random(7)
    leaving = set(rng.sample(range(STREAMS), WALK_AWAY))
    # The first half streams long answers, so that the kill below finds some of them open.
    clients = [
        Client(server.url, i in leaving, rng, max_tokens=480 if i < STREAMS // 2 else 120)
        for i in range(STREAMS)
    ]
    started = time.monotonic()
    for client in clients[: STREAMS // 2]:
        client.start()
    time.sleep(0.5)
    open_streams = deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        open_streams = [c for c in clients[: STREAMS // 2] if c.outcome == "running" and c.chunks >= 3]
        if open_streams:
            break
        time.sleep(0.02)
    assert open_streams, [(c.outcome, c.chunks) for c in clients]
    engine = server.engine("tiny", "v1")
    os.kill(engine._process.pid, signal.SIGKILL)  # mid-stream: every open stream of v1 fails
    for client in clients[STREAMS // 2 :]:
        client.start()
    time.sleep(0.3)
    server.manifest_path.write_text(one_version_yaml(tiny_model_v2_dir, "v2"))
    for client in clients:
        client.join(timeout=max(1.0, 45 - (time.monotonic() - started)))

    outcomes = [(c.outcome, c.detail) for c in clients]
    assert not [c for c in clients if c.is_alive()], f"hung: {outcomes}"
    allowed = ("completed", "error event", "walked away", "status 500", "status 503", "status 429")
    assert not [o for o in outcomes if o[0] not in allowed], outcomes
    assert not [d for _, d in outcomes if "internal error" in d], outcomes  # each error says what failed
    counts = {o: sum(1 for c in clients if c.outcome == o) for o in allowed}
    assert counts["completed"] and (counts["error event"] + counts["status 500"] + counts["status 503"]), (
        counts
    )
    assert counts["walked away"] <= WALK_AWAY

    deadline = time.monotonic() + 20
    while not (idle := settled(server))[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert idle[0], idle[1]
    metrics = httpx.get(f"{server.url}/metrics").text
    for line in metrics.splitlines():
        if line.startswith(("modelfleet_num_requests_running", "modelfleet_pod_requests_waiting")):
            assert line.endswith(" 0.0"), line
    # The new version serves.
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.headers["x-modelfleet-version"] == "v2"
