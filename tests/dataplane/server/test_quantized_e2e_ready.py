"""bench/quantized_e2e.py's wait for the server: a version that failed to load ends the wait at once with
its reason (a failed load is not retried for a while, so polling /ready on would only run the clock out)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest


@pytest.fixture
def e2e(bench_scripts):
    import quantized_e2e

    return quantized_e2e


def ready_server(status: int, body: dict):
    class Ready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def running_server():
    """What wait_ready asks of a bench Server: a process still running, its log and tail."""
    return SimpleNamespace(
        proc=SimpleNamespace(poll=lambda: None, returncode=None), log="serve.log", tail=str
    )


def test_a_failed_load_ends_the_wait_with_its_reason(e2e):
    failed = {
        "model": "chat",
        "version": "v2",
        "state": "failed",
        "error": "ValueError: max_model_len: 4096 > 2048",
    }
    loading = {"model": "chat", "version": "v1", "state": "loading", "error": None}
    server = ready_server(503, {"ready": False, "versions": [loading, failed]})
    try:
        with pytest.raises(
            e2e.StepFailed, match=r"serve-ready: a version failed to load: chat@v2: ValueError: max_model_len"
        ):
            e2e.wait_ready(running_server(), f"http://127.0.0.1:{server.server_port}", timeout=30)
    finally:
        server.shutdown()


def test_a_loading_version_is_waited_for_and_ready_returns(e2e):
    loading = ready_server(
        503, {"ready": False, "versions": [{"model": "chat", "version": "v1", "state": "loading"}]}
    )
    try:
        with pytest.raises(e2e.StepFailed, match="/ready not 200 after 2 s"):
            e2e.wait_ready(running_server(), f"http://127.0.0.1:{loading.server_port}", timeout=2)
    finally:
        loading.shutdown()
    ready = ready_server(200, {"ready": True, "versions": []})
    try:
        assert e2e.wait_ready(running_server(), f"http://127.0.0.1:{ready.server_port}", timeout=30) < 5
    finally:
        ready.shutdown()
