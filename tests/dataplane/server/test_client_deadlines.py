"""Clients that hold server resources by being slow or silent: each is cut off within its deadline, its
request (if any) aborted, and the server's places freed for others. Deadlines are set to fractions of a
second here; the defaults are in settings.py."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
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


def websocket_upgrade(server: GuardedServer, *, rcvbuf: int | None = None) -> tuple[socket.socket, bytes]:
    """A raw socket and the upgrade head for /v1/stream (the caller sends it)."""
    sock = connect(server, rcvbuf=rcvbuf)
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = (
        f"GET /v1/stream?api_key={KEY} HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    return sock, upgrade


def text_frame(data: dict) -> bytes:
    """One masked text frame, as a client sends it."""
    payload = json.dumps(data).encode()
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return b"\x81" + bytes([0x80 | 126]) + len(payload).to_bytes(2, "big") + mask + masked


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    while marker not in data and time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got = sock.recv(65536)
        except TimeoutError:
            break
        if not got:
            break
        data += got
    return data


def test_a_websocket_request_sent_with_its_upgrade_head_is_answered(server: GuardedServer):
    """A first frame that arrives in the same read as the upgrade head (n=8 here) was dropped by
    uvicorn's HTTP protocol, so that request was never admitted nor answered."""
    sock, upgrade = websocket_upgrade(server)
    request = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3, "n": 8, "ignore_eos": True}
    sock.sendall(upgrade + text_frame(request))  # one write: one segment on loopback
    data = read_until(sock, b'"type":"done"', 60)
    assert data.startswith(b"HTTP/1.1 101"), data[:200]
    assert b'"type":"start"' in data and b'"type":"done"' in data, data[-300:]
    indices = {int(m) for m in re.findall(rb'"index":(\d+)', data)}
    assert indices == set(range(8))
    sock.close()


def test_a_websocket_request_with_n_8_is_answered(server: GuardedServer):
    from websockets.sync.client import connect as ws_connect

    url = server.url.replace("http://", "ws://") + f"/v1/stream?api_key={KEY}"
    with ws_connect(url, max_size=None) as ws:
        ws.send(json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 3, "n": 8, "ignore_eos": True}))
        messages = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(json.loads(ws.recv(timeout=60)))
    assert messages[0]["type"] == "start" and messages[-1]["type"] == "done", messages[-1]
    texts: dict[int, str] = {}
    for message in messages[1:-1]:
        for choice in message["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == list(range(8))
    assert messages[-1]["usage"]["completion_tokens"] == 8 * 3


def test_a_websocket_nobody_reads_is_closed_and_frees_its_places(server: GuardedServer):
    """The same over the WebSocket: a message the client does not take within the send deadline ends
    its request (before, the send waited for good and the request kept its places)."""
    engine = server.engine("tiny", "v1")
    free_before = engine.stats().num_free_blocks
    before = server.metric("modelfleet_client_timeouts_total", reason="send")
    sock, upgrade = websocket_upgrade(server, rcvbuf=2048)
    sock.sendall(upgrade)
    assert read_until(sock, b"\r\n\r\n", 30).startswith(b"HTTP/1.1 101")  # as RFC 6455 clients do
    request = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "n": 8, "logprobs": 5}
    sock.sendall(text_frame({**request, "ignore_eos": True}))
    gate = server.dataplane.admission
    timed_out = lambda: server.metric("modelfleet_client_timeouts_total", reason="send") > before  # noqa: E731
    # Admitted, a place per sequence (on a loaded machine the 0.5 s deadline may already have ended it).
    assert wait_until(lambda: gate.running == 8 or timed_out(), 30)
    assert wait_until(lambda: gate.running == 0, 20), "the unread socket still holds its places"
    assert server.metric("modelfleet_client_timeouts_total", reason="send") == before + 1
    assert wait_until(lambda: engine.stats().num_running == 0, 5)
    assert wait_until(lambda: engine.stats().num_free_blocks == free_before, 5)
    sock.close()
