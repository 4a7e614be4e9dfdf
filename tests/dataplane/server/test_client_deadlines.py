"""Clients that hold server resources by being slow or silent: each is cut off within its deadline, its
request (if any) aborted, and the server's places freed for others. Deadlines are set to fractions of a
second here; the defaults are in settings.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from modelfleet.dataplane.server.settings import ServerSettings

from .guarded import KEY, GuardedServer, connect, head, key_file, read_until_closed, tiny_manifest

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardedServer]:
    settings = ServerSettings(
        api_key_file=key_file(tmp_path_factory.mktemp("keys")),
        header_timeout_seconds=0.5,
        body_timeout_seconds=0.5,
        keep_alive_timeout_seconds=0.5,
        send_timeout_seconds=0.5,
        max_request_body_bytes=LIMIT,
    )
    live = GuardedServer(settings, tiny_manifest(tiny_model_dir), sndbuf=4096).start()
    live.wait_ready()
    yield live
    live.stop()


def status_and_body(data: bytes) -> tuple[int, dict]:
    head_part, _, body = data.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(body)


def test_an_unauthenticated_body_is_refused_before_it_is_read(server: GuardedServer):
    """50 MB announced, 1 KB sent, no key: 401 at once (the server waited for the rest before)."""
    sock = connect(server)
    sock.sendall(head("POST", "/v1/completions", length=50_000_000) + b"x" * 1024)
    data, closed_after = read_until_closed(sock, timeout=3)
    status, body = status_and_body(data)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert closed_after < 1  # connection: close, the unread body is never taken for a request


def test_a_declared_body_over_the_limit_is_refused_at_once(server: GuardedServer):
    sock = connect(server)
    sock.sendall(head("POST", "/v1/completions", length=LIMIT + 1, key=KEY))
    data, _ = read_until_closed(sock, timeout=3)
    status, body = status_and_body(data)
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and str(LIMIT) in body["error"]["message"]


def test_a_chunked_body_is_refused_when_it_passes_the_limit(server: GuardedServer):
    sock = connect(server)
    sock.sendall(head("POST", "/v1/completions", key=KEY, chunked=True))
    chunk = b"x" * 16384
    for _ in range(LIMIT // len(chunk) + 1):
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    data, _ = read_until_closed(sock, timeout=3)
    status, body = status_and_body(data)
    assert status == 413 and "at least" in body["error"]["message"]


def test_a_body_that_stalls_gets_408(server: GuardedServer):
    before = server.metric("modelfleet_client_timeouts_total", reason="body")
    sock = connect(server)
    started = time.monotonic()
    sock.sendall(head("POST", "/v1/completions", length=100, key=KEY) + b'{"model": ')
    data, _ = read_until_closed(sock, timeout=3)
    status, body = status_and_body(data)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 2
    assert server.metric("modelfleet_client_timeouts_total", reason="body") == before + 1


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: te"])
def test_a_connection_without_a_whole_request_head_is_closed(server: GuardedServer, sent: bytes):
    """Silent, or sending its head slowly: both were kept open for good."""
    socks = [connect(server) for _ in range(20)]
    for sock in socks:
        sock.sendall(sent)
    for sock in socks:
        _, closed_after = read_until_closed(sock, timeout=3)
        assert closed_after < 3


def test_a_request_head_over_64_kib_is_refused(server: GuardedServer):
    """uvicorn's httptools parser kept every header it was sent, for as long as they came."""
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
    try:
        for _ in range(100):
            sock.sendall(b"X-Pad: " + b"a" * 1024 + b"\r\n")
        sock.sendall(b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while sending
    data, _ = read_until_closed(sock, timeout=3)
    assert data.startswith(b"HTTP/1.1 400")


def test_an_idle_keep_alive_connection_is_closed(server: GuardedServer):
    sock = connect(server)
    sock.sendall(head("GET", "/health"))
    data, closed_after = read_until_closed(sock, timeout=3)
    assert data.startswith(b"HTTP/1.1 200") and closed_after < 3


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_stream_nobody_reads_is_aborted_and_frees_its_places(server: GuardedServer):
    """A client that asks for a long stream and never reads: once its socket is full for longer than
    the send deadline the request is aborted; admission, engine and KV cache are back to idle."""
    engine = server.engine("tiny", "v1")
    free_before = engine.stats().num_free_blocks
    before = server.metric("modelfleet_client_timeouts_total", reason="send")
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 480,
            "n": 8,
            "logprobs": 5,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    sock = connect(server, rcvbuf=2048)
    sock.sendall(head("POST", "/v1/completions", length=len(body), key=KEY) + body)
    gate = server.dataplane.admission
    assert wait_until(lambda: gate.running == 8, 30)  # a place per sequence
    assert wait_until(lambda: gate.running == 0, 20), "the unread stream still holds its place"
    assert server.metric("modelfleet_client_timeouts_total", reason="send") == before + 1
    assert wait_until(lambda: engine.stats().num_running == 0, 5)
    assert engine.stats().num_free_blocks == free_before
    answer = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert answer.status_code == 200
    sock.close()
