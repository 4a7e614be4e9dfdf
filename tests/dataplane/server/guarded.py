"""A live server configured as `modelfleet serve` configures it (connection deadlines, keep-alive), and
raw-socket helpers for clients that misbehave on purpose."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.server.auth import hash_key
from modelfleet.dataplane.server.connections import uvicorn_config
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import TEST_ENGINE, LiveServer

KEY = "test-key"


class GuardedServer(LiveServer):
    def __init__(
        self, settings: ServerSettings, manifest: ServingManifest, *, sndbuf: int | None = None, **kwargs
    ) -> None:
        super().__init__(settings, manifest, **kwargs)
        config = uvicorn_config(
            self.app, settings, host="127.0.0.1", port=0, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        listener = socket.socket()
        if sndbuf is not None:  # a slow network: the kernel holds little of an unread response
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        listener.bind(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def metric(self, name: str, **labels: str) -> float:
        value = self.dataplane.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


def tiny_manifest(model_dir: Path, **engine: object) -> ServingManifest:
    """Model `tiny`, one preloaded version v1, the test engine settings with `engine` over them."""
    settings = ", ".join(f"{k}: {v}" for k, v in {**TEST_ENGINE, **engine}.items())
    version = f'{{name: v1, weight: 100, artifact: "{model_dir}", preload: true}}'
    return ServingManifest.from_yaml(
        f"models:\n  - name: tiny\n    engine: {{{settings}}}\n    versions:\n      - {version}\n"
    )


def key_file(tmp_path: Path, *entries: str) -> Path:
    """A key file holding KEY's digest, or the JSON entries given."""
    path = tmp_path / "keys"
    path.write_text("[" + ",".join(entries) + "]" if entries else hash_key(KEY) + "\n")
    return path


def connect(server: GuardedServer, *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window the server sees is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(server.address)
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when it did (seconds from now);
    (data, inf) if it was still open after `timeout`."""
    start = time.monotonic()
    data = b""
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            return data, float("inf")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, float("inf")
        except ConnectionResetError:
            return data, time.monotonic() - start
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def head(
    method: str, path: str, *, length: int | None = None, key: str | None = None, chunked=False
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
