"""Fixtures for the converter tests: one download/ONNX cache per session, and a Range-capable HTTP server."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def convert_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared --cache-dir: the float32 ONNX export of the tiny model is made once for all ONNX tests."""
    return tmp_path_factory.mktemp("convert-cache")


class RangeServer(http.server.ThreadingHTTPServer):
    """Serves `root`; honours `Range: bytes=N-`; cuts the first GET of each file in `flaky` after half."""

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.flaky: set[str] = set()
        self.requests: list[tuple[str, str | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: RangeServer

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        path = self.server.root / name
        self.server.requests.append((name, self.headers.get("Range")))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        if (spec := self.headers.get("Range")) and spec.startswith("bytes="):
            start = int(spec[6:].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        if name in self.server.flaky:
            self.server.flaky.discard(name)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)  # drop the connection mid-body
            return
        self.wfile.write(body)


@pytest.fixture
def serve() -> Iterator:
    """serve(root) -> a running RangeServer over `root`; all are stopped after the test."""
    servers: list[RangeServer] = []

    def start(root: Path) -> RangeServer:
        server = RangeServer(root)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def http_server(serve, tiny_model_dir: Path) -> RangeServer:
    return serve(tiny_model_dir)
