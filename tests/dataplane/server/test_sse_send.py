"""Streamed bodies go to the server's send past the middlewares' wrappers; the wrappers still see the
response start (status for the span, "started" for the error middleware)."""

from __future__ import annotations

import asyncio
import json

import pytest
from modelfleet.dataplane.server.app import create_app
from modelfleet.dataplane.server.streaming import ServerSendApp, SseResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.dataplane.server.test_dataplane import traced_dataplane


class SeenSends:
    """A middleware recording the message types that pass through its send wrapper."""

    def __init__(self, app: ASGIApp, seen: list[str]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def recording(message: Message) -> None:
            self.seen.append(message["type"])
            await send(message)

        await self.app(scope, receive, recording)


async def call(
    app: ASGIApp, path: str, body: dict | None = None, sent: list[Message] | None = None
) -> list[Message]:
    """One HTTP request straight into the ASGI app; the messages the server's send got (in `sent` where
    given, which keeps them when the app raises)."""
    payload = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST" if body is not None else "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    requested = False
    never = asyncio.Event()

    async def receive() -> Message:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await never.wait()  # the client stays connected
        return {"type": "http.disconnect"}

    sent = [] if sent is None else sent

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


@pytest.fixture
async def served():
    dp, exporter = traced_dataplane()
    seen: list[str] = []
    app = create_app(dp)
    app.add_middleware(SeenSends, seen=seen)
    yield app, seen, exporter
    await dp.close()


async def test_stream_chunks_skip_the_wrappers_and_the_span_still_gets_the_status(served):
    app, seen, exporter = served
    sent = await call(
        app, "/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 4, "stream": True}
    )
    assert seen == ["http.response.start"]  # the middleware saw the start, no chunk
    assert [m["type"] for m in sent].count("http.response.start") == 1
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    events = [line.removeprefix("data: ") for line in body.splitlines() if line]
    assert events[-1] == "[DONE]" and len(events) == 5  # four token chunks, [DONE]
    assert sent[-1] == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    assert all(m["more_body"] for m in sent[1:-1])
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    assert span.attributes["http.response.status_code"] == 200


async def test_an_answer_that_is_not_streamed_still_takes_the_wrappers(served):
    app, seen, _ = served
    sent = await call(app, "/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 2})
    assert seen == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and json.loads(sent[1]["body"])["usage"]["completion_tokens"] == 2


async def test_an_error_after_the_start_ends_the_stream_and_is_not_made_a_500():
    app = ServerSendApp()

    async def chunks():
        yield "two"
        raise RuntimeError("broken renderer")

    @app.get("/s")
    async def stream() -> SseResponse:
        return SseResponse("one", chunks())

    sent: list[Message] = []
    with pytest.raises(RuntimeError, match="broken renderer"):
        await call(app, "/s", sent=sent)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[0]["status"] == 200 and [m["body"] for m in sent[1:]] == [b"data: one\n\n", b"data: two\n\n"]


def endless_stream_app(produced: list[int]) -> ServerSendApp:
    app = ServerSendApp()

    async def chunks():
        for i in range(10_000):
            produced.append(i)
            await asyncio.sleep(0.005)
            yield str(i)

    @app.get("/s")
    async def stream() -> SseResponse:
        return SseResponse(None, chunks())

    return app


def get_scope() -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/s",
        "raw_path": b"/s",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


def client_receive(leaves: asyncio.Event) -> Receive:
    """A client's receive: its (empty) request, then its disconnect once `leaves` is set."""
    requested = False

    async def receive() -> Message:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await leaves.wait()
        return {"type": "http.disconnect"}

    return receive


async def test_a_client_leaving_mid_stream_ends_the_response_quietly():
    produced: list[int] = []
    sent: list[Message] = []
    left = asyncio.Event()

    async def send(message: Message) -> None:
        sent.append(message)
        if len(sent) == 4:  # the start and three chunks out: the client goes
            left.set()

    task = asyncio.ensure_future(endless_stream_app(produced)(get_scope(), client_receive(left), send))
    await asyncio.wait_for(task, timeout=5)  # returns: the disconnect is not an error
    assert task.cancelling() == 0
    assert 3 <= len(produced) <= 5  # the body stopped with the client
    assert all(m.get("more_body", True) for m in sent[1:])  # no [DONE] to a client that left


async def test_a_streaming_response_cancelled_by_the_server_stays_cancelled():
    """A cancellation that is not the client's (the server stopping) propagates as before."""
    produced: list[int] = []

    async def send(message: Message) -> None:
        pass

    app = endless_stream_app(produced)
    task = asyncio.ensure_future(app(get_scope(), client_receive(asyncio.Event()), send))
    while len(produced) < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stopped_at = len(produced)
    await asyncio.sleep(0.05)
    assert len(produced) == stopped_at


async def test_a_send_to_a_closed_connection_is_the_clients_disconnect():
    """Servers of ASGI spec 2.4 raise OSError from send once the connection is gone (Starlette's rule)."""

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection closed")

    app = endless_stream_app([])
    with pytest.raises(ClientDisconnect):
        await app(get_scope(), client_receive(asyncio.Event()), send)
