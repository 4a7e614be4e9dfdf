"""Connection deadlines uvicorn lacks: a client that never finishes its request head, or stops reading a
response, loses its connection instead of holding it (and the request's admission place) forever.

- head: from the connection's start, or the end of its previous response, the next request head must
  arrive within `header_timeout_seconds` (uvicorn's keep-alive timer stops at the first byte, so a client
  sending its head one byte at a time would otherwise keep the connection).
- upgrade: bytes a client sends right behind its WebSocket upgrade head (its first frame, before the
  101 came back) reach the WebSocket; uvicorn's protocols passed on only the head and dropped them, so
  that request was never answered.
- send: once the transport's write buffer is full, the client must take data again within
  `send_timeout_seconds`; else the connection is aborted, the app sees a disconnect and its request is
  cancelled (engine request aborted, KV blocks and admission place freed).

`uvicorn_config` is how every server of this package is configured, tests included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import uvicorn
from modelfleet.dataplane.server.settings import ServerSettings

OnTimeout = Callable[[str], None]  # called with "header" or "send"
MAX_HEAD_BYTES = 64 * 1024  # a request line and headers larger than this are refused (400)


class _Deadlines:
    """Mixed into uvicorn's HTTP protocols (h11 and httptools share these names)."""

    header_timeout: float
    send_timeout: float
    on_timeout: OnTimeout
    head_error: type[Exception] = ValueError  # what the parser turns into a 400 (httptools)
    upgrade_error: type[Exception] = ValueError  # what the parser raises at an upgrade head (httptools)
    _head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._send_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._after_upgrade = b""
        parser = getattr(self, "parser", None)
        if parser is not None:  # httptools: its upgrade exception says where the head ended
            self.parser = _UpgradeOffset(parser, self)
        self._arm_head_deadline()

    def handle_websocket_upgrade(self, *args: Any) -> None:
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]
        rest = self._after_upgrade
        conn = getattr(self, "conn", None)
        if conn is not None:  # h11 keeps what followed the head
            rest = bytes(conn.trailing_data[0])
        self._after_upgrade = b""
        if rest:
            self.transport.get_protocol().data_received(rest)  # type: ignore[attr-defined]

    def _arm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self.header_timeout, self._head_deadline, self.cycle)  # type: ignore[attr-defined]

    def _head_deadline(self, cycle_then: Any) -> None:
        transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing() or transport.get_protocol() is not self:  # closed, or now a WebSocket
            return
        cycle = self.cycle
        if cycle is cycle_then and (cycle is None or cycle.response_complete):  # no new head since armed
            self.on_timeout("header")
            transport.abort()

    # httptools keeps every header it is sent (h11 has its own bound): count the head's bytes.
    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()  # type: ignore[misc]

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)  # type: ignore[misc]

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise self.head_error(f"request head over {MAX_HEAD_BYTES} bytes")

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self._arm_head_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._send_timer is None:
            loop = asyncio.get_running_loop()
            self._send_timer = loop.call_later(self.send_timeout, self._send_deadline)

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().resume_writing()  # type: ignore[misc]

    def _send_deadline(self) -> None:
        self._send_timer = None
        if not self.transport.is_closing() or self.transport.get_write_buffer_size():  # type: ignore[attr-defined]
            self.on_timeout("send")
            self.transport.abort()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._send_timer, self._head_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]


class _UpgradeOffset:
    """httptools' parser, keeping the bytes after an upgrade head for the WebSocket that takes over."""

    def __init__(self, parser: Any, owner: _Deadlines) -> None:
        self._parser = parser
        self._owner = owner

    def feed_data(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except self._owner.upgrade_error as exc:
            if exc.args:
                self._owner._after_upgrade = bytes(data[exc.args[0] :])
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


def protocol_class(settings: ServerSettings, on_timeout: OnTimeout) -> type[asyncio.Protocol]:
    """uvicorn's fastest available HTTP protocol (httptools, else h11) with the deadlines above."""
    attrs: dict[str, Any] = {
        "header_timeout": settings.header_timeout_seconds,
        "send_timeout": settings.send_timeout_seconds,
        "on_timeout": staticmethod(on_timeout),
    }
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base

        attrs["head_error"] = httptools.HttpParserError
        attrs["upgrade_error"] = httptools.HttpParserUpgrade
    except ImportError:  # httptools is optional
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return type(f"Guarded{base.__name__}", (_Deadlines, base), attrs)


def uvicorn_config(app: Any, settings: ServerSettings, **overrides: Any) -> uvicorn.Config:
    """The server's uvicorn settings: client deadlines, keep-alive and the WebSocket message limit."""
    metrics = getattr(getattr(app.state, "dataplane", None), "metrics", None)

    def on_timeout(reason: str) -> None:
        if metrics is not None:
            metrics.client_timeouts.labels(reason).inc()

    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "http": protocol_class(settings, on_timeout),
        "timeout_keep_alive": settings.keep_alive_timeout_seconds,
        "ws_max_size": settings.max_request_body_bytes,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)
