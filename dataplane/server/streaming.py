"""Streamed response bodies written past the middlewares, straight to the server's `send`.

Every layer between the server and a route (Starlette's error and exception middlewares, our span
middleware) wraps `send` to watch `http.response.start`: they record the status, and remember that the
response began so that a later error is not turned into a 500. Once the start has passed they only
forward, yet each SSE chunk of every stream would still go through all of them. The app keeps the
server's own `send` in the scope; an `SseResponse` sends its start through the layers (they see it as
before) and its body chunks to the server's send. No layer here rewrites bodies (no compression): one
that did would have to be added before this response is used.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping

from fastapi import FastAPI
from modelfleet.dataplane.server.errors import ServerError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SERVER_SEND = "modelfleet.server_send"


class ServerSendApp(FastAPI):
    """FastAPI that leaves the server's `send` in each HTTP request's scope, under SERVER_SEND."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class SseResponse(StreamingResponse):
    """OpenAI's event stream of JSON chunks: each sent as `data: {chunk}` past the middlewares' send
    wrappers, a ServerError raised mid-stream sent as an error event (the status line is gone), and
    `data: [DONE]` last, in the body's final write."""

    media_type = "text/event-stream"

    def __init__(
        self, first: str | None, chunks: AsyncGenerator[str, None], headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(chunks, headers=headers)
        self.first, self.chunks = first, chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Without ServerSendApp above it (another ASGI host), every chunk takes the wrapped send.
        self._body_send: Send = scope.get(SERVER_SEND, send)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send
        # A stream cancelled while it writes (the client left) is closed by the event loop's
        # async-generator finalizer, not here, where anyio would cancel its cleanup's awaits too.
        try:
            if self.first is not None:
                await body_send({"type": "http.response.body", "body": _event(self.first), "more_body": True})
            async for chunk in self.chunks:
                await body_send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
            last = DONE
        except ServerError as exc:  # failed mid-stream: the status line is gone, so say it in the stream
            last = _event(json.dumps(exc.body())) + DONE
        await body_send({"type": "http.response.body", "body": last, "more_body": False})


DONE = b"data: [DONE]\n\n"


def _event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()
