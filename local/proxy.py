"""A Service as a local endpoint: an asyncio HTTP proxy on 127.0.0.1 that sends each request to one of the
ready replicas (round robin) and streams the answer back as it comes.

One request per client connection (answers carry `Connection: close`), so a replica that dies mid-answer
ends exactly that client's stream. A streamed answer (chunked `text/event-stream`) is passed on whole
events at a time, so that one whose replica broke off still reaches the client well formed, ending in an
error event (OpenAI's error body) the client raises; any other body just stops short of its end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)
Endpoints = Callable[[], list[tuple[str, int]]]
HEAD_LIMIT = 64 * 1024
CHUNK = 64 * 1024


class ProxyError(Exception):
    """The client's request cannot be forwarded; `status` is what it gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ServiceProxy:
    def __init__(self, name: str, endpoints: Endpoints, host: str = "127.0.0.1", port: int = 0) -> None:
        self.name, self.endpoints, self.host, self.port = name, endpoints, host, port
        self._turn = itertools.count()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=HEAD_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end the connections still open (their replicas are going too)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        try:
            head, body = await _read_request(reader)
            await self._forward(head, body, writer)
        except ProxyError as exc:
            await _answer(writer, exc.status, str(exc))
        except ValueError:
            await _answer(writer, 400, "malformed HTTP request")
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away
        finally:
            writer.close()

    async def _forward(self, head: list[str], body: bytes, client: asyncio.StreamWriter) -> None:
        backend = await self._connect()
        if backend is None:
            raise ProxyError(503, f"service {self.name} has no ready replica")
        reader, writer = backend
        try:
            writer.write(_rewrite_head(head, len(body)) + body)
            await writer.drain()
            response = await reader.readuntil(b"\r\n\r\n")
            lines = response.decode("latin-1").split("\r\n")[:-2]
            client.write(_close_head(lines))
            if _is_chunked_event_stream(lines):
                await self._relay_events(reader, client)
                return
            while chunk := await reader.read(CHUNK):
                client.write(chunk)
                await client.drain()
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            log.warning("service %s: a replica broke off an answer: %s", self.name, exc)
        finally:
            writer.close()

    async def _relay_events(self, replica: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        """The replica's chunked events, passed on one whole event or more per chunk; if the replica breaks
        off, its partial event is dropped and an error event ends the stream instead."""
        pending = b""
        while True:
            try:
                data = await _read_chunk(replica)
            except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
                log.warning("service %s: a replica broke off a stream: %s", self.name, exc)
                message = f"the replica of service {self.name} serving this stream stopped before its end"
                error = {"error": {"message": message, "type": "server_error", "code": "replica_lost"}}
                client.write(_chunk(f"data: {json.dumps(error)}\n\n".encode()))
                break
            if data is None:
                break
            pending += data
            end = pending.rfind(b"\n\n") + 2  # 1 when there is no whole event yet
            if end > 1:
                client.write(_chunk(pending[:end]))
                pending = pending[end:]
                await client.drain()
        client.write(b"0\r\n\r\n")
        await client.drain()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to a ready replica, trying the others when one refuses (nothing is sent yet)."""
        ready = self.endpoints()
        if not ready:
            return None
        start = next(self._turn)
        for i in range(len(ready)):
            host, port = ready[(start + i) % len(ready)]
            try:
                return await asyncio.open_connection(host, port, limit=HEAD_LIMIT)
            except OSError:
                continue
        return None


async def _read_request(reader: asyncio.StreamReader) -> tuple[list[str], bytes]:
    raw = await reader.readuntil(b"\r\n\r\n")
    head = raw.decode("latin-1").split("\r\n")[:-2]
    headers = _headers(head)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while (data := await _read_chunk(reader)) is not None:
            body += data
        return head, body
    length = int(headers.get("content-length") or 0)
    return head, await reader.readexactly(length) if length else b""


def _is_chunked_event_stream(lines: list[str]) -> bool:
    headers = _headers(lines)
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    return chunked and headers.get("content-type", "").lower().startswith("text/event-stream")


def _headers(head: list[str]) -> dict[str, str]:
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}


async def _read_chunk(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked body; None at its end (trailers, which replicas do not send, are refused)."""
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    data = await reader.readexactly(size + 2)
    if data[-2:] != b"\r\n":
        raise ValueError("a chunk does not end with CRLF")
    return data[:-2] if size else None


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _rewrite_head(head: list[str], length: int) -> bytes:
    """The request for the replica: one request per connection, the body with its length."""
    drop = ("connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection")
    lines = [head[0]] + [h for h in head[1:] if h.partition(":")[0].strip().lower() not in drop]
    lines += [f"Content-Length: {length}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _close_head(lines: list[str]) -> bytes:
    kept = [lines[0]] + [
        h for h in lines[1:] if h.partition(":")[0].strip().lower() not in ("connection", "keep-alive")
    ]
    return ("\r\n".join([*kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")


async def _answer(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "code": status}}).encode()
    reason = {503: "Service Unavailable", 400: "Bad Request"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        writer.write(head.encode() + body)
        await writer.drain()
    except ConnectionError:
        pass
