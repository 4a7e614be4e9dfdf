"""The first thing every HTTP request meets, before any route reads or parses its body:

1. API paths (`/v1/...`) check the API key from the headers: without a valid one the answer is 401 at
   once and the body is never read.
2. A declared `Content-Length` over `max_request_body_bytes` is refused with 413 at once; a chunked
   body is counted as it arrives and refused the moment it passes the limit.
3. The whole body must arrive within `body_timeout_seconds` of the request head, else 408.

The body read here is handed to the app unchanged; every later `receive()` goes to the client (the
app still hears a disconnect). Refusals close the connection, since the body was not read.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from modelfleet.dataplane.server.dataplane import UNKNOWN_MODEL
from modelfleet.dataplane.server.errors import ServerError, error_body
from modelfleet.dataplane.server.settings import ServerSettings
from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_PREFIX = "/v1/"


class _Refused(Exception):
    def __init__(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}


class RequestGuard:
    def __init__(self, app: ASGIApp, *, settings: ServerSettings, dataplane: Any) -> None:
        self.app = app
        self.max_bytes = settings.max_request_body_bytes
        self.body_timeout = settings.body_timeout_seconds
        self.dataplane = dataplane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._authenticate(scope)
            self._check_declared_length(scope)
            messages = await self._read_body(receive)
        except _Refused as refused:
            await _refuse(send, refused)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _authenticate(self, scope: Scope) -> None:
        if not scope["path"].startswith(API_PREFIX):
            return
        keys = self.dataplane.keys
        keys.refresh()
        try:
            scope.setdefault("state", {})["principal"] = keys.authenticate(header(scope, b"authorization"))
        except ServerError as exc:
            self._count(exc.status)
            raise _Refused(exc.status, exc.body(), exc.headers) from None

    def _check_declared_length(self, scope: Scope) -> None:
        declared = header(scope, b"content-length")
        if declared is None:
            return
        try:
            length = int(declared)
        except ValueError:
            self._count(400)
            message = "Content-Length: is not a number"
            raise _Refused(
                400, error_body(message, type_="invalid_request_error", code="invalid_request")
            ) from None
        if length > self.max_bytes:
            self._too_large(length)

    async def _read_body(self, receive: Receive) -> list[Message]:
        """The request's body messages, read within the size and time limits."""
        messages: list[Message] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self._count(408)
                self.dataplane.metrics.client_timeouts.labels("body").inc()
                text = f"request body: not received within {self.body_timeout:g} s; send it faster"
                raise _Refused(
                    408, error_body(text, type_="invalid_request_error", code="request_timeout")
                ) from None
            messages.append(message)
            if message["type"] != "http.request":  # the client left: let the app hear it
                return messages
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                self._too_large(size, counted=True)
            if not message.get("more_body", False):
                return _joined(messages)

    def _too_large(self, size: int, *, counted: bool = False) -> None:
        self._count(413)
        what = "at least" if counted else "declared as"
        message = (
            f"request body: {what} {size} bytes, over the server's limit of {self.max_bytes} "
            "(max_request_body_bytes); send a smaller request"
        )
        raise _Refused(413, error_body(message, type_="invalid_request_error", code="request_too_large"))

    def _count(self, status: int) -> None:
        self.dataplane.metrics.requests.labels(UNKNOWN_MODEL, "", str(status)).inc()


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _joined(messages: list[Message]) -> list[Message]:
    """One message holding the whole body: the app reads it in one step."""
    body = b"".join(m.get("body", b"") for m in messages)
    return [{"type": "http.request", "body": body, "more_body": False}]


async def _refuse(send: Send, refused: _Refused) -> None:
    payload = json.dumps(refused.body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),  # the unread body must not be taken for the next request
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in refused.headers.items()),
    ]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
