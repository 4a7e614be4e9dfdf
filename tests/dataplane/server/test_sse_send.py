"""Streamed bodies go to the server's send past the middlewares' wrappers; the wrappers still see the
response start (status for the span, "started" for the error middleware)."""

from __future__ import annotations

import asyncio
import json

import pytest
from modelfleet.dataplane.server.app import create_app
from modelfleet.dataplane.server.streaming import ServerSendApp, SseResponse
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
