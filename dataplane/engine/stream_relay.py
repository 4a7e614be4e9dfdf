"""Stream relays: processes that write streamed answers to the clients' sockets, so that the server
process, which is one interpreter, does not pay for every token of every stream.

A server streaming hundreds of answers spends most of its time per token: taking the engine's output,
rendering its chunk and writing it to the client. Past ~25k tokens/s one process is busy all the time,
and the engine waits for it. An engine process (engine_process.py) can hand that work to relays:

1. The server adds a request with a relay as its sink (`Add.sink`). The engine process sends the
   request's first output to the server as usual (a refusal or an error before the first token is
   still an HTTP error) and every later one to the relay (`RelayRows`).
2. Once the server has written the response's head and its first chunks, it hands the relay the
   connection's socket and the chunk template (`Handoff`, the socket passed with SCM_RIGHTS). The
   relay writes each later output as an SSE chunk of that template, in HTTP chunked framing, with the
   socket's own non-blocking writes; outputs that came before the handoff wait in order.
   Where the engine's tokenizer decodes in a stream (detokenizer.StreamDecoder) and the request has no
   stop strings, the engine stops decoding its text after the first output: its rows carry the new
   tokens alone, the first with where the decoder starts (`RelayRows.handovers`), and the relay decodes
   them with the tokenizer the engine sent it at start (`RelayTokenizer`). Text is per-token work the
   engine's one thread would otherwise do for every stream, beside the model.
3. At the request's last output the relay tells the server what it wrote (`RelayDone`: token counts
   and inter-token gaps for the metrics, the finish reason or error, or that the client left); the
   server then writes the usage chunk, `data: [DONE]` and the end of the body itself.

The server can take a stream back before handing it off (`Handoff` without a template: the relay
forwards the outputs to it, `Forwarded`), and drop one it gave up on (`Drop`). A relay holds no state
the server needs: if it dies, the server fails its streams with an error event (and aborts their
requests). Whatever else ends a relayed stream comes through its relay, so that the server writes to the
socket only behind the relay's bytes: a failed step is an error row (`RelayDone.error`), and if the
engine process dies, the relay writes the rows it has (or ends a connection it is stuck writing to)
and exits, and only then does the server fail its streams.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from multiprocessing.connection import Connection
from typing import Any, Protocol

from modelfleet.dataplane.engine.detokenizer import Handover, StreamDecoder

logger = logging.getLogger(__name__)

# Seconds a relay remembers a request dropped before any of its rows came (rows the engine sent before
# it took the server's abort come within a step or two).
DROP_MEMORY = 60.0

# One output of a relayed request, engine -> relay: request id, new text (None: decode the tokens here),
# new token ids, finish reason, finished, error. Tuples: a relay rebuilds no engine classes (and imports
# neither torch nor pydantic).
RelayRow = tuple[str, str | None, list[int], str | None, bool, str | None]
TextRow = tuple[str, str, list[int], str | None, bool, str | None]  # a row with its text, as written


@dataclass(frozen=True, slots=True)
class RelayRows:
    """Engine -> relay: one step's outputs of the requests relayed here, and for each request whose
    first row without text is among them, where its decoder starts."""

    rows: list[RelayRow]
    handovers: dict[str, Handover] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RelayTokenizer:
    """Engine -> relay, at start: the tokenizer (its JSON) to decode rows without text with."""

    json: str


@dataclass(frozen=True, slots=True)
class Handoff:
    """Server -> relay: write the rest of `request_id` to the socket that follows this message, each
    output as `head + text + middle + finish reason + tail`; without a template, forward the rest to the
    server instead (no socket follows)."""

    request_id: str
    template: tuple[str, str, str] | None
    last_output_at: float = 0.0  # time.monotonic() of the output before (the clock is the machine's)


@dataclass(frozen=True, slots=True)
class Drop:
    """Server -> relay: the server gave the request up (client gone, cancelled): write nothing more."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Forwarded:
    """Relay -> server: outputs of a request that was taken back (Handoff without a template)."""

    rows: list[TextRow]


@dataclass(frozen=True, slots=True)
class RelayDone:
    """Relay -> server: the relay wrote the request's last output (or could not).

    `counts`: per output written, its token count and the gap per token since the previous output
    (None for the first one written here: the server timed the one before). `client_gone`: a write
    failed or the client stopped reading for `send_timeout` seconds; the server aborts the request.
    """

    request_id: str
    counts: list[tuple[int, float | None]]
    finish_reason: str | None
    error: str | None = None
    client_gone: bool = False


RelayMessage = Handoff | Drop


class StreamSink(Protocol):
    """Where a relay may write the rest of a stream: the server's side of a handoff."""

    template: tuple[str, str, str] | None  # the stream's chunk template: head, middle, tail
    last_output_at: float  # time.monotonic() when the server took the stream's latest output

    def socket_fd(self) -> int | None:
        """The connection's descriptor, if a relay may write to it now (its write buffer is empty)."""


@dataclass
class _Stream:
    """A relayed request, from its first row here to its last."""

    rows: list[tuple[TextRow, float]] = field(default_factory=list)  # with their arrival, until the handoff
    sock: socket.socket | None = None
    template: tuple[str, str, str] | None = None
    handed: bool = False
    forward: bool = False  # taken back by the server
    dropped: bool = False
    finished: bool = False  # its last row came
    pending: bytes = b""  # written when the socket takes it
    stalled_since: float = 0.0
    counts: list[tuple[int, float | None]] = field(default_factory=list)
    last: float = 0.0  # when the previous output with tokens arrived (here or at the server)
    done: RelayDone | None = None  # sent once `pending` is out
    decoder: StreamDecoder | None = None  # for rows without text


def chunk_bytes(template: tuple[str, str, str], text: str, finish_reason: str | None) -> bytes:
    """One SSE event of the template in HTTP/1.1 chunked framing (the response's head said chunked)."""
    head, middle, tail = template
    reason = "null" if finish_reason is None else encode_basestring(finish_reason)
    event = f"data: {head}{encode_basestring(text)}{middle}{reason}{tail}\n\n".encode()
    return b"%x\r\n%b\r\n" % (len(event), event)


def run_relay(engine_conn: Connection, server_conn: Connection, send_timeout: float) -> None:
    """A relay process's main: rows from the engine, handoffs from the server, writes to sockets."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which closes this
    relay = _Relay(engine_conn, server_conn, send_timeout)
    with contextlib.suppress(EOFError, OSError):
        relay.run()
    relay.end_unfinished_writes()
    os._exit(0)  # the sockets are the server's: nothing else here to flush or close politely


class _Relay:
    def __init__(self, engine_conn: Connection, server_conn: Connection, send_timeout: float) -> None:
        self.engine, self.server, self.send_timeout = engine_conn, server_conn, send_timeout
        self.streams: dict[str, _Stream] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(engine_conn.fileno(), selectors.EVENT_READ, self._from_engine)
        self.selector.register(server_conn.fileno(), selectors.EVENT_READ, self._from_server)
        self.stalled: dict[int, str] = {}  # socket fd -> request id, while its writes wait
        # Dropped before any row came: rows may never come (refused, or ended at the first output, which
        # was the server's) or come later on the other pipe. Their rows are ignored; the ids are kept
        # DROP_MEMORY seconds, in the order dropped, then forgotten.
        self.unseen_drops: dict[str, float] = {}
        self.tokenizer: Any = None  # from the engine (RelayTokenizer), where it hands text over

    def run(self) -> None:
        while True:
            timeout = 1.0 if self.stalled or self.unseen_drops else None
            for key, _ in self.selector.select(timeout):
                key.data(key.fd)
            self._expire_stalled()
            self._expire_unseen_drops()

    def end_unfinished_writes(self) -> None:
        """At exit: a connection whose client stopped reading may be left inside a chunk, where the
        server's error event could not follow; it is shut down (the client would get nothing more)."""
        for stream in self.streams.values():
            if stream.pending and stream.sock is not None:
                with contextlib.suppress(OSError):
                    stream.sock.shutdown(socket.SHUT_RDWR)

    # -- inputs ---------------------------------------------------------------------------------------

    def _from_engine(self, _fd: int) -> None:
        message = self.engine.recv()
        if isinstance(message, RelayTokenizer):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_str(message.json)
            return
        now = time.monotonic()
        forwarded: list[TextRow] = []
        for row in message.rows:
            if row[0] in self.unseen_drops:
                if row[4]:
                    del self.unseen_drops[row[0]]
                continue
            stream = self.streams.get(row[0])
            if stream is None:
                stream = self.streams[row[0]] = _Stream()
            stream.finished = stream.finished or row[4]
            if stream.dropped:
                self._forget_if_over(row[0], stream)
                continue
            text_row = self._with_text(stream, row, message.handovers)
            if stream.forward:
                forwarded.append(text_row)
            elif stream.handed:
                self._write_row(row[0], stream, text_row, now)
            else:
                stream.rows.append((text_row, now))
            self._forget_if_over(row[0], stream)
        if forwarded:
            self.server.send(Forwarded(forwarded))

    def _with_text(self, stream: _Stream, row: RelayRow, handovers: dict[str, Handover]) -> TextRow:
        """The row with its text: a row without is decoded from its tokens here (in order: the decoder
        holds state)."""
        request_id, text, token_ids, finish_reason, finished, error = row
        if text is None:
            decoder = stream.decoder
            if decoder is None:
                context, held = handovers[request_id]
                decoder = stream.decoder = StreamDecoder(self.tokenizer, context, held)
            text = decoder.add(token_ids, flush=finished)
        return request_id, text, token_ids, finish_reason, finished, error

    def _from_server(self, _fd: int) -> None:
        message: RelayMessage = self.server.recv()
        stream = self.streams.get(message.request_id)
        if stream is None and isinstance(message, Drop):
            self.unseen_drops[message.request_id] = time.monotonic()
            return
        if stream is None:
            stream = self.streams[message.request_id] = _Stream()
        if isinstance(message, Drop):
            stream.dropped = True
            self._unstall(stream)
            stream.rows, stream.pending = [], b""
            self._close(stream)
        elif message.template is None:
            stream.forward = True
            if stream.rows:
                self.server.send(Forwarded([row for row, _ in stream.rows]))
                stream.rows = []
        else:
            from multiprocessing.reduction import recv_handle

            fd = recv_handle(self.server)
            stream.sock = socket.socket(fileno=fd)
            stream.template, stream.handed, stream.last = message.template, True, message.last_output_at
            rows, stream.rows = stream.rows, []
            for row, arrived in rows:
                self._write_row(message.request_id, stream, row, arrived)
        self._forget_if_over(message.request_id, stream)

    # -- writes ---------------------------------------------------------------------------------------

    def _write_row(self, request_id: str, stream: _Stream, row: TextRow, now: float) -> None:
        _, text, token_ids, finish_reason, finished, error = row
        if stream.done is not None:
            return  # the client is gone: the rest is dropped
        count = len(token_ids)
        if count:
            stream.counts.append((count, (now - stream.last) / count if stream.last else None))
            stream.last = now
        if error is not None or finish_reason == "error":
            stream.done = RelayDone(request_id, stream.counts, "error", error or "unknown error")
        else:
            assert stream.template is not None
            reason = finish_reason if finished else None
            self._send(request_id, stream, chunk_bytes(stream.template, text, reason))
            if finished and stream.done is None:
                stream.done = RelayDone(request_id, stream.counts, finish_reason)
        self._report_if_done(request_id, stream)

    def _send(self, request_id: str, stream: _Stream, data: bytes) -> None:
        if stream.pending:
            stream.pending += data
            return
        assert stream.sock is not None
        try:
            sent = stream.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:  # reset, broken pipe: the client is gone
            self._gone(request_id, stream)
            return
        if sent < len(data):
            stream.pending = data[sent:]
            stream.stalled_since = time.monotonic()
            self.stalled[stream.sock.fileno()] = request_id
            self.selector.register(stream.sock.fileno(), selectors.EVENT_WRITE, self._writable)

    def _writable(self, fd: int) -> None:
        request_id = self.stalled.get(fd)
        stream = self.streams.get(request_id) if request_id is not None else None
        if request_id is None or stream is None or stream.sock is None:
            return
        try:
            sent = stream.sock.send(stream.pending)
        except BlockingIOError:
            return
        except OSError:
            self._gone(request_id, stream)
            return
        stream.pending = stream.pending[sent:]
        if not stream.pending:
            self._unstall(stream)
            self._report_if_done(request_id, stream)

    def _expire_stalled(self) -> None:
        """A client that stopped reading loses its stream after send_timeout (the server's own rule)."""
        now = time.monotonic()
        for request_id in list(self.stalled.values()):
            stream = self.streams.get(request_id)
            if stream is not None and now - stream.stalled_since > self.send_timeout:
                self._gone(request_id, stream)

    def _expire_unseen_drops(self) -> None:
        drops, expired = self.unseen_drops, time.monotonic() - DROP_MEMORY
        while drops and next(iter(drops.values())) < expired:
            del drops[next(iter(drops))]

    def _gone(self, request_id: str, stream: _Stream) -> None:
        self._unstall(stream)
        stream.pending = b""
        stream.done = RelayDone(request_id, stream.counts, None, client_gone=True)
        self._report_if_done(request_id, stream)

    def _unstall(self, stream: _Stream) -> None:
        if stream.sock is not None and self.stalled.pop(stream.sock.fileno(), None) is not None:
            self.selector.unregister(stream.sock.fileno())

    def _report_if_done(self, request_id: str, stream: _Stream) -> None:
        """Tell the server once everything is written: it writes the body's end behind our bytes."""
        if stream.done is not None and not stream.pending and stream.sock is not None:
            self.server.send(stream.done)
            self._close(stream)
            self._forget_if_over(request_id, stream)

    def _close(self, stream: _Stream) -> None:
        if stream.sock is not None:
            # This process's duplicate of the connection's descriptor: closing it leaves the connection,
            # which is the server's, open (only a shutdown() would end it).
            stream.sock.close()
            stream.sock = None

    def _forget_if_over(self, request_id: str, stream: _Stream) -> None:
        """A request is forgotten once its last row came and nothing more is owed for it."""
        written = stream.handed and stream.sock is None
        if stream.finished and (stream.dropped or stream.forward or written):
            self.streams.pop(request_id, None)
