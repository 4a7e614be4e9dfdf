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

from fastapi import FastAPI
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
    """A text/event-stream whose body chunks (str or bytes) skip the middlewares' send wrappers."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Without ServerSendApp above it (another ASGI host), every chunk takes the wrapped send.
        self._body_send: Send = scope.get(SERVER_SEND, send)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send
        async for chunk in self.body_iterator:
            body = chunk.encode() if isinstance(chunk, str) else chunk
            await body_send({"type": "http.response.body", "body": body, "more_body": True})
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})
