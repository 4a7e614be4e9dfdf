"""Streamed response bodies written past the middlewares, straight to the server's `send`.

Every layer between the server and a route (Starlette's error and exception middlewares, our span
middleware) wraps `send` to watch `http.response.start`: they record the status, and remember that the
response began so that a later error is not turned into a 500. Once the start has passed they only
forward, yet each SSE chunk of every stream would still go through all of them. The app keeps the
server's own `send` in the scope; an `SseResponse` sends its start through the layers (they see it as
before) and its body chunks to the server's send. No layer here rewrites bodies (no compression): one
that did would have to be added before this response is used.

With a `SocketSink`, a stream relay (engine/stream_relay.py) may write the chunks after the first
token's straight to the connection's socket; the response then writes its last chunks (usage,
`[DONE]`) once the relay says it is done. The sink hands over uvicorn's httptools connection only when
the response is chunked and nothing is waiting in its write buffer, so the bytes stay in order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from fastapi import FastAPI
from modelfleet.dataplane.server.errors import ClientGone, ServerError
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SERVER_SEND = "modelfleet.server_send"


class ServerSendApp(FastAPI):
    """FastAPI that leaves the server's `send` in each HTTP request's scope, under SERVER_SEND."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class SocketSink:
    """A stream's connection, for a stream relay to write to (engine.stream_relay.StreamSink)."""

    def __init__(self, template: tuple[str, str, str]) -> None:
        self.template: tuple[str, str, str] | None = template
        self.last_output_at = 0.0
        self._cycle: Any = None

    def bind(self, send: Send) -> None:
        """The server's own send of this response (uvicorn's httptools cycle), once its head is out."""
        cycle: Any = getattr(send, "__self__", None)
        if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl" or not cycle.chunked_encoding:
            return
        if cycle.transport.get_extra_info("sslcontext") is None:  # a relay writes plain bytes: never TLS
            self._cycle = cycle

    def socket_fd(self) -> int | None:
        cycle = self._cycle
        if cycle is None or cycle.disconnected or cycle.transport.is_closing():
            return None
        if cycle.transport.get_write_buffer_size():  # bytes still queued here would come after the relay's
            return None
        sock = cycle.transport.get_extra_info("socket")
        return None if sock is None else sock.fileno()

    def abort(self) -> None:
        """Ends the connection of a client that stopped reading (as the server's send deadline does)."""
        if self._cycle is not None:
            self._cycle.transport.abort()


class SseResponse(StreamingResponse):
    """OpenAI's event stream of JSON chunks: each sent as `data: {chunk}` past the middlewares' send
    wrappers, a ServerError raised mid-stream sent as an error event (the status line is gone), and
    `data: [DONE]` last, in the body's final write."""

    media_type = "text/event-stream"

    def __init__(
        self,
        first: str | None,
        chunks: AsyncGenerator[str, None],
        headers: Mapping[str, str] | None = None,
        sink: SocketSink | None = None,
    ) -> None:
        super().__init__(chunks, headers=headers)
        self.first, self.chunks, self.sink = first, chunks, sink

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Without ServerSendApp above it (another ASGI host), every chunk takes the wrapped send.
        self._body_send: Send = scope.get(SERVER_SEND, send)
        # Starlette streams the body beside a watch for the client's disconnect in an anyio task group,
        # whose cancel scopes took about a sixth of the event loop's time per streamed request (py-spy,
        # `bench/stream_overhead.py --output-len 2`). The same with asyncio alone: the watch cancels this
        # task when the client leaves, and the cancellation ends here, as the task group's did.
        streaming = asyncio.current_task()
        assert streaming is not None  # ASGI apps run in a task
        client_left = False

        async def watch() -> None:
            nonlocal client_left
            while (await receive())["type"] != "http.disconnect":
                pass
            client_left = True
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not client_left or streaming.uncancel():  # cancelled for another reason too
                raise
        except OSError as exc:  # an ASGI 2.4 server's send to a closed connection, as Starlette takes it
            raise ClientDisconnect() from exc
        finally:
            watcher.cancel()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send
        if self.sink is not None:
            self.sink.bind(body_send)
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
        except ClientGone:
            if self.sink is not None:
                self.sink.abort()
            return
        await body_send({"type": "http.response.body", "body": last, "more_body": False})


DONE = b"data: [DONE]\n\n"


def _event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()
