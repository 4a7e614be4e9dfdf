"""Tests across the borders of two parts: what one part produces, fed as it is to the other.

`run_server` starts the real model server (uvicorn on a free port, in a thread) the way the data-plane
pod would: from MODELFLEET_* settings and a serving manifest file.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from modelfleet.dataplane.manifest import load_manifest
from modelfleet.dataplane.server.runtime import build_app
from modelfleet.dataplane.server.settings import ServerSettings


class Server:
    def __init__(self, settings: ServerSettings, manifest_path: Path) -> None:
        self.app = build_app(settings, load_manifest(manifest_path), manifest_path=manifest_path)
        self.dataplane = self.app.state.dataplane
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def start(self, timeout: float = 60) -> Server:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while (ready := httpx.get(f"{self.url}/ready")).status_code != 200:
            failed = [v for v in ready.json()["versions"] if v["state"] == "failed"]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready: {ready.json()}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture()
def run_server() -> Iterator[Callable[[ServerSettings, Path], Server]]:
    servers: list[Server] = []

    def start(settings: ServerSettings, manifest_path: Path) -> Server:
        server = Server(settings, manifest_path).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
