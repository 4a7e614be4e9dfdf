"""AsyncLLMProcess: the engine loop in a process of its own, streamed to asyncio callers like AsyncLLM.

In one process the engine thread and the HTTP server's event loop share one interpreter lock: every
token of every stream costs the event loop tens of microseconds of Python, the engine's step waits for
the lock behind it, and the GPU idles. Here the engine steps in a child process (spawned: CUDA cannot
be forked) and the caller's process only checks requests, tokenizes and serves.

Parent and child talk over one pipe, in the messages of messages.py. Parent -> child: `Add` (the token
ids and checked parameters), `Abort`, `Close`. Child -> parent: `Ready` (the engine's limits),
`Outputs` (with the stats as of that step), `Refused` (one request), `StepFailed` when a step raised,
`StartFailed` when the engine could not be built, `Fatal` just before it exits because it can step no
more (a tensor-parallel rank died). A reader thread in the parent delivers outputs to the requests'
streams; if the child dies, every open stream ends with an error and `failure` says why, so that the
owner (the server's model manager) starts a new engine.

With `stream_relays`, the process also starts that many relay processes (stream_relay.py) and the
engine process sends them the outputs after the first of the requests added with a relay as sink
(`generate(..., sink=...)`): the relays write those streams to the clients' sockets.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import socket
import threading
from collections.abc import Callable, Collection
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path
from typing import Any

from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.detokenizer import Handover
from modelfleet.dataplane.engine.llm_engine import LLMEngine, PromptChecks
from modelfleet.dataplane.engine.messages import (
    Abort,
    Add,
    Close,
    Command,
    Fatal,
    Outputs,
    Ready,
    Refused,
    Reply,
    StartFailed,
    StepFailed,
)
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.engine.protocol import EngineLimits
from modelfleet.dataplane.engine.stream_relay import (
    Drop,
    Forwarded,
    Handoff,
    RelayDone,
    RelayRow,
    RelayRows,
    RelayTokenizer,
    StreamSink,
    TextRow,
    run_relay,
)
from modelfleet.dataplane.engine.threaded import ThreadedEngine

logger = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """The engine process could not start, or stopped."""


class _RelayLink:
    """The server's end of one relay process: handoffs and drops out, what it wrote back in."""

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process, self.conn = process, conn
        self.lock = threading.Lock()  # held by each send, and by the close
        self.requests: set[str] = set()  # relayed here and not yet over
        self.alive = True
        self.reader: threading.Thread | None = None

    def send(self, message: Handoff | Drop, fd: int | None = None) -> bool:
        try:
            with self.lock:
                self.conn.send(message)
                if fd is not None:
                    send_handle(self.conn, fd, self.process.pid)
            return True
        except (OSError, ValueError):  # the relay is gone: its reader fails its streams
            return False

    def shut_down(self) -> None:
        """Ends the pipe for both of its ends: the relay exits, and our reader, even one blocked in a
        read, gets an end of file (a close would wake neither: the blocked read holds the socket)."""
        with self.lock, contextlib.suppress(OSError):
            if not self.conn.closed:
                with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as pipe:
                    pipe.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Once the reader has ended. A descriptor closed while another thread is about to read or
        write it may by then be a new connection's (a client's request), and get the pipe's bytes."""
        if self.reader is not None and self.reader.is_alive():
            logger.error("stream relay %s: its reader did not end; its pipe is left open", self.process.pid)
            return
        with self.lock:
            self.conn.close()


class AsyncLLMProcess(PromptChecks, ThreadedEngine):
    adds_token_ids = True

    def __init__(
        self,
        model: str | Path,
        *,
        stream_relays: int = 0,
        send_timeout: float = 30.0,
        child: Callable[[Connection, list[Connection]], None] | None = None,
        **engine_config: Any,
    ) -> None:
        """`child`: the engine process's main, given its pipe and its ends of the relays' pipes
        (default: run_engine_process with this config; a benchmark passes a stand-in)."""
        from modelfleet.dataplane.engine.llm_engine import load_tokenizer
        from transformers import AutoTokenizer

        config = EngineConfig.from_kwargs(model, **engine_config)  # bad settings fail here, not in the child
        if stream_relays < 0:
            raise ValueError(f"stream_relays: {stream_relays} must be >= 0")
        context = multiprocessing.get_context("spawn")
        relays = [_start_relay(context, send_timeout) for _ in range(stream_relays)]
        self._relays = [link for link, _ in relays]
        self.stream_relays = stream_relays
        self._conn, child_conn = context.Pipe()
        to_relays = [end for _, end in relays]
        child = child or functools.partial(run_engine_process, config=config)
        self._process = context.Process(
            target=child, args=(child_conn, to_relays), name="modelfleet-engine", daemon=True
        )
        self._process.start()
        child_conn.close()
        for end in to_relays:
            end.close()
        ready = self._receive_start()
        if not isinstance(ready, Ready):
            self._process.join(timeout=30)
            self._stop_relays()
            raise EngineProcessError(f"the engine process could not start: {ready.message}")
        self._limits = ready.limits
        self.text_in_relays = ready.text_in_relays  # its relays decode the text of the streams they write
        self.max_model_len: int = ready.limits.max_model_len
        self.vocab_size: int = ready.limits.vocab_size
        self._stats: EngineStats = ready.stats
        self.tokenizer = load_tokenizer(AutoTokenizer, config.model)
        self._tokenizer_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._next_relay = 0
        self.streams_handed_off = 0  # streams whose rest a relay wrote to the client's socket
        self._start("modelfleet-engine-io")
        for index, link in enumerate(self._relays):
            name = f"modelfleet-relay-io-{index}"
            link.reader = threading.Thread(target=self._read_relay, args=(link,), name=name, daemon=True)
            link.reader.start()

    def _stop_relays(self) -> None:
        for link in self._relays:
            link.shut_down()  # a relay exits when the server's end ends
        for link in self._relays:
            link.process.join(timeout=5)
            if link.process.is_alive():
                link.process.kill()
            if link.reader is not None:
                link.reader.join(timeout=10)
            link.close()

    def _receive_start(self) -> Ready | StartFailed:
        try:
            reply = self._conn.recv()
        except EOFError:
            return StartFailed(f"it exited with code {self._process.exitcode} before it was ready")
        return reply if isinstance(reply, Ready | StartFailed) else StartFailed(f"it sent {reply!r} first")

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def stats(self) -> EngineStats:
        """As of the engine's latest step."""
        return self._stats

    def _pick_relay(self, request_id: str) -> int:
        """The live relay (1-based) with the fewest streams, ties in turn; 0 (this process) if none."""
        start = self._next_relay = (self._next_relay + 1) % len(self._relays)
        order = [link for link in self._relays[start:] + self._relays[:start] if link.alive]
        if not order:
            return 0
        link = min(order, key=lambda link: len(link.requests))
        link.requests.add(request_id)
        return self._relays.index(link) + 1

    def _hand_off(self, request_id: str, relay: int, sink: StreamSink) -> None:
        """After the stream's first output: its socket to the relay, or the stream back to this process
        (where the socket is busy or unknown) by a handoff without a template."""
        link = self._relays[relay - 1]
        fd = sink.socket_fd() if sink.template is not None else None
        if fd is None:
            sent = link.send(Handoff(request_id, None))
        else:
            sent = link.send(Handoff(request_id, sink.template, sink.last_output_at), fd)
            self.streams_handed_off += sent
        if not sent:  # the relay died: the outputs it was sent are lost with it
            self._relay_stopped([request_id])

    def _relay_over(self, request_id: str, relay: int, finished: bool) -> None:
        link = self._relays[relay - 1]
        link.requests.discard(request_id)
        if not finished:  # given up before its end: the relay writes nothing more of it
            link.send(Drop(request_id))

    def _read_relay(self, link: _RelayLink) -> None:
        """A relay's reader thread: what it wrote (RelayDone) or forwards, to the requests' streams."""
        while True:
            try:
                message = link.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, RelayDone):
                self._deliver(message.request_id, _relayed_output(message))
            elif isinstance(message, Forwarded):
                self._deliver_all((row[0], _row_output(row)) for row in message.rows)
        link.alive = False
        # A relay exits by itself (code 0) when its engine pipe closes, as the engine process ends. The
        # engine's reader ends on the same, having set `failure`; wait for it (the engine process may
        # not be reaped yet: is_alive() cannot tell).
        link.process.join(timeout=5)
        if link.process.exitcode == 0:
            self._thread.join(timeout=5)
        engine_gone = not self._thread.is_alive()
        if not self._closed and not engine_gone:
            logger.error("stream relay %s exited (code %s)", link.process.pid, link.process.exitcode)
        if engine_gone:
            failed = EngineProcessError(self.failure or "the engine process stopped")
            self._deliver_all((request_id, failed) for request_id in list(link.requests))
        else:
            self._relay_stopped(list(link.requests))

    def _relay_stopped(self, request_ids: list[str]) -> None:
        """Fails streams whose relay died, and stops their requests: a stream that ends in an error
        does not abort its request (the engine has ended it, as a rule), and the engine would write
        the rest of these to nobody."""
        failed = EngineProcessError("the stream relay writing this answer stopped")
        self._deliver_all((request_id, failed) for request_id in request_ids)
        for request_id in request_ids:
            self._submit(Abort(request_id))

    def _submit(self, command: Command) -> None:
        # Straight to the child: no thread of this process has to wake for it.
        try:
            with self._send_lock:
                self._conn.send(command)
        except (OSError, ValueError):  # the child is gone: the reader thread fails the open streams
            if isinstance(command, Add):  # and this one may have opened after it did
                stopped = EngineProcessError(self.failure or "the engine process stopped")
                self._deliver(command.request_id, stopped)

    def _run(self) -> None:
        """Reader thread: the child's messages to the requests' streams."""
        fatal = None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Outputs):
                self._stats = message.stats
                self._deliver_all((output.request_id, output) for output in message.outputs)
            elif isinstance(message, Refused):
                self._deliver(message.request_id, ValueError(message.message))
            elif isinstance(message, StepFailed):
                logger.error("engine step failed: %s", message.message)
                # A relayed stream ends with its relay's report: its socket may still be the relay's.
                self._fail_all(RuntimeError(f"engine step failed: {message.message}"), message.relayed)
            elif isinstance(message, Fatal):
                fatal = message.message
        if not self._closed:
            self._process.join(timeout=5)  # for its exit code
            self.failure = f"the engine process exited (code {self._process.exitcode})"
            if fatal is not None:
                self.failure = f"{fatal}; {self.failure}"
            logger.error("%s", self.failure)
            if self.on_failure is not None:
                try:
                    self.on_failure(self.failure)
                except Exception:  # the owner's hook must not keep the streams below from ending
                    logger.exception("the engine's failure hook raised")
        # A relayed stream is failed by its relay's reader once the relay, which exits with the engine
        # process, has written the rows it had: until then its socket is not this process's to write.
        relayed = {request_id for link in self._relays for request_id in list(link.requests)}
        self._fail_all(EngineProcessError(self.failure or "the engine process stopped"), relayed)

    def _fail_all(self, exc: Exception, spared: Collection[str] = ()) -> None:
        """Ends every open stream with `exc`, but those `spared`."""
        self._deliver_all((request_id, exc) for request_id in list(self._streams) if request_id not in spared)

    def close(self) -> None:
        self._closed = True
        self._submit(Close())
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        # The child's end closed as it exited: the reader ends at that end of file. Only then, and
        # under the send lock, is ours closed (see _RelayLink.close: a closed descriptor's number is
        # soon a new connection's, and a thread still holding it would read or write that).
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            logger.error("the engine process's reader did not end; its pipe is left open")
        else:
            with self._send_lock:
                self._conn.close()
        self._stop_relays()


def _start_relay(context: Any, send_timeout: float) -> tuple[_RelayLink, Connection]:
    """A relay process; returns the server's link to it and the end the engine process sends on."""
    from_engine, to_relay = context.Pipe(duplex=False)
    server_end, relay_end = context.Pipe()  # duplex: a socket pair, which can carry descriptors
    process = context.Process(
        target=run_relay, args=(from_engine, relay_end, send_timeout), name="modelfleet-relay", daemon=True
    )
    process.start()
    from_engine.close()
    relay_end.close()
    return _RelayLink(process, server_end), to_relay


def _relayed_output(done: RelayDone) -> RequestOutput:
    """The stream's last output: what its relay wrote (finished unless the client left)."""
    return RequestOutput(
        done.request_id,
        [],
        finish_reason=done.finish_reason,
        finished=not done.client_gone,
        error=done.error,
        delta=True,
        relayed=done,
    )


def _row_output(row: TextRow) -> RequestOutput:
    """A forwarded row as the delta output it was (relayed requests never ask for logprobs)."""
    request_id, text, token_ids, finish_reason, finished, error = row
    return RequestOutput(
        request_id, [], text, token_ids, text, token_ids, None, finish_reason, finished, error, delta=True
    )


def run_engine_process(conn: Connection, to_relays: list[Connection], config: EngineConfig) -> None:
    """The child's main: build the engine, then step it, applying commands between steps."""
    from modelfleet.dataplane.observability import configure_logging

    configure_logging(logging.WARNING)
    try:
        engine = LLMEngine(config)
    except Exception as exc:
        conn.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    locked = _LockedConnection(conn)  # the tensor-parallel monitor thread sends too
    # A dead rank may leave this process waiting in a collective for good: say why, and exit.
    engine.set_failure_hook(functools.partial(_exit_fatal, locked))
    limits = EngineLimits(config.max_num_seqs, engine.max_model_len, engine.model_config.vocab_size)
    routes = OutputRoutes(locked, to_relays)
    routes.share_tokenizer(engine.stream_tokenizer(), engine.release_text)
    locked.send(Ready(limits, engine.stats(), routes.text_in_relays))
    with contextlib.suppress(EOFError, OSError):  # the parent is gone
        _serve(locked, engine, routes)
    engine.close()


class OutputRoutes:
    """Where an engine process sends each output: to the server, or, for a request added with a relay
    as its sink, every output after its first to that relay (stream_relay.py). Once the relays have the
    engine's tokenizer, a relayed request's text is decoded there: its rows carry tokens alone."""

    def __init__(self, conn: Any, to_relays: list[Connection]) -> None:
        self.conn, self.to_relays = conn, to_relays
        self._first: dict[str, int] = {}  # relayed requests whose first output has not gone out
        self._relayed: dict[str, int] = {}  # the others, until their last output
        self._dead: set[int] = set()
        self._release_text: Callable[[str], Handover | None] | None = None
        # Relayed requests whose rows carry no text, with their handover until their first row goes out.
        self._decoded_there: dict[str, Handover | None] = {}

    @property
    def text_in_relays(self) -> bool:
        """Whether relayed requests' text is decoded by their relays."""
        return self._release_text is not None

    def share_tokenizer(self, tokenizer: str | None, release_text: Callable[[str], Handover | None]) -> None:
        """Sends every relay the tokenizer (stream_tokenizer's JSON; None: text stays in the engine);
        from then on a relayed request's text is released to its relay (`release_text`) after its
        first output."""
        if tokenizer is None or not self.to_relays:
            return
        for relay, end in enumerate(self.to_relays, start=1):
            try:
                end.send(RelayTokenizer(tokenizer))
            except (OSError, ValueError):
                self._dead.add(relay)
        self._release_text = release_text

    def add(self, request_id: str, sink: int) -> None:
        if sink and self.to_relays:
            self._first[request_id] = sink

    def fail(self, aborted: list[RequestOutput], error: str) -> frozenset[str]:
        """A failed step's aborted requests: those relayed end with `error` at their relays, which write
        what they hold first (the server, which fails the others, must not write to their sockets).
        Returns their ids."""
        relayed = frozenset(output.request_id for output in aborted if output.request_id in self._relayed)
        failed = [replace(output, finish_reason="error", error=error) for output in aborted]
        self._route(failed)  # the server's own are dropped: it fails them on StepFailed
        return relayed

    def send(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """One step's outputs; the server gets its own with the stats (even none: the stats move)."""
        self.conn.send(Outputs(self._route(outputs), stats))

    def _route(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Sends the relays their rows; returns the server's outputs."""
        if not self._first and not self._relayed:  # nothing relayed: every output is the server's
            return outputs
        mine: list[RequestOutput] = []
        rows: dict[int, list[RelayRow]] = {}
        handovers: dict[int, dict[str, Handover]] = {}
        for output in outputs:
            request_id = output.request_id
            relay = self._relayed.get(request_id)
            if relay is None:
                first = self._first.pop(request_id, None)
                if first is not None and not output.finished:
                    self._relayed[request_id] = first
                    self._release(request_id)
                mine.append(output)
                continue
            text: str | None = output.new_text
            if request_id in self._decoded_there:
                text = None
                handover = self._decoded_there[request_id]
                if handover is not None:
                    handovers.setdefault(relay, {})[request_id] = handover
                    self._decoded_there[request_id] = None
            if output.finished:
                del self._relayed[request_id]
                self._decoded_there.pop(request_id, None)
            row = (
                request_id,
                text,
                output.new_token_ids,
                output.finish_reason,
                output.finished,
                output.error,
            )
            rows.setdefault(relay, []).append(row)
        for relay, relay_rows in rows.items():
            if relay not in self._dead:
                try:
                    self.to_relays[relay - 1].send(RelayRows(relay_rows, handovers.get(relay, {})))
                except (OSError, ValueError):  # the server fails the streams of a relay that died
                    self._dead.add(relay)
        return mine

    def _release(self, request_id: str) -> None:
        """After a relayed request's first output: its later text is decoded by its relay, if it can be."""
        if self._release_text is None:
            return
        handover = self._release_text(request_id)
        if handover is not None:
            self._decoded_there[request_id] = handover


class _LockedConnection:
    """The child's end of the pipe: commands in, replies out (sent from two threads)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def recv(self) -> Command:
        command: Command = self._conn.recv()
        return command

    def poll(self) -> bool:
        return self._conn.poll()

    def send(self, message: Reply) -> None:
        with self._lock:
            self._conn.send(message)


def _exit_fatal(conn: _LockedConnection, reason: str) -> None:
    logging.getLogger(__name__).error("the engine can step no more: %s", reason)
    with contextlib.suppress(OSError, ValueError):
        conn.send(Fatal(reason))
    os._exit(1)


def _serve(conn: _LockedConnection, engine: LLMEngine, routes: OutputRoutes) -> None:
    while True:
        # Idle: wait for a command. Busy: take what has arrived, then step.
        if not engine.has_unfinished_requests() and not _apply(conn.recv(), routes, engine):
            return
        while conn.poll():
            if not _apply(conn.recv(), routes, engine):
                return
        if not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step()
        except Exception as exc:  # a broken step fails every request in flight, loudly
            logging.getLogger(__name__).exception("engine step failed")
            if engine.failure is not None:
                # The engine can run no more steps (a tensor-parallel rank died, which broke this one):
                # the process ends, and its end names the cause, not the collective's error it caused.
                _exit_fatal(conn, engine.failure)
            message = f"{type(exc).__name__}: {exc}"
            aborted = [engine.abort(request_id) for request_id in list(engine.scheduler.requests)]
            relayed = routes.fail(
                [output for output in aborted if output is not None], f"engine step failed: {message}"
            )
            conn.send(StepFailed(message, relayed))
            continue
        if outputs:
            routes.send(outputs, engine.stats())


def _apply(command: Command, routes: OutputRoutes, engine: LLMEngine) -> bool:
    """Applies one command; False for `Close`."""
    if isinstance(command, Add):
        try:
            engine.add_request(
                command.request_id, command.prompt, priority=command.priority, validated=command.validated
            )
        except ValueError as exc:
            routes.conn.send(Refused(command.request_id, str(exc)))
        else:
            routes.add(command.request_id, command.sink)
    elif isinstance(command, Abort):
        output = engine.abort(command.request_id)
        if output is not None:
            routes.send([output], engine.stats())
    elif isinstance(command, Close):
        return False
    return True
