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
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.llm_engine import LLMEngine, Prompt, PromptChecks
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
from modelfleet.dataplane.engine.outputs import EngineStats
from modelfleet.dataplane.engine.protocol import EngineLimits
from modelfleet.dataplane.engine.threaded import ThreadedEngine
from modelfleet.dataplane.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """The engine process could not start, or stopped."""


class AsyncLLMProcess(PromptChecks, ThreadedEngine):
    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        from modelfleet.dataplane.engine.llm_engine import load_tokenizer
        from transformers import AutoTokenizer

        config = EngineConfig.from_kwargs(model, **engine_config)  # bad settings fail here, not in the child
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=run_engine_process, args=(child_conn, config), name="modelfleet-engine", daemon=True
        )
        self._process.start()
        child_conn.close()
        ready = self._receive_start()
        if not isinstance(ready, Ready):
            self._process.join(timeout=30)
            raise EngineProcessError(f"the engine process could not start: {ready.message}")
        self._limits = ready.limits
        self.max_model_len: int = ready.limits.max_model_len
        self.vocab_size: int = ready.limits.vocab_size
        self._stats: EngineStats = ready.stats
        self.tokenizer = load_tokenizer(AutoTokenizer, config.model)
        self._tokenizer_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._start("modelfleet-engine-io")
        # What exists now (the libraries, the server) lives as long as the process: leave it out of
        # full collections, which would otherwise scan it all and stall the event loop for tens of ms.
        gc.collect()
        gc.freeze()

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

    def _add_command(
        self, request_id: str, prompt: Prompt, priority: int, validated: tuple[list[int], SamplingParams]
    ) -> Add:
        # The child needs the token ids alone: a prompt text stays here.
        return Add(request_id, validated[0], priority, validated)

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
                self._fail_all(RuntimeError(f"engine step failed: {message.message}"))
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
        self._fail_all(EngineProcessError(self.failure or "the engine process stopped"))

    def _fail_all(self, exc: Exception) -> None:
        self._deliver_all((request_id, exc) for request_id in list(self._streams))

    def close(self) -> None:
        self._closed = True
        self._submit(Close())
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        self._conn.close()
        self._thread.join(timeout=30)


def run_engine_process(conn: Connection, config: EngineConfig) -> None:
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
    locked.send(Ready(limits, engine.stats()))
    with contextlib.suppress(EOFError, OSError):  # the parent is gone
        _serve(locked, engine)
    engine.close()


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


def _serve(conn: _LockedConnection, engine: LLMEngine) -> None:
    while True:
        # Idle: wait for a command. Busy: take what has arrived, then step.
        if not engine.has_unfinished_requests() and not _apply(conn.recv(), conn, engine):
            return
        while conn.poll():
            if not _apply(conn.recv(), conn, engine):
                return
        if not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step()
        except Exception as exc:  # a broken step fails every request in flight, loudly
            logging.getLogger(__name__).exception("engine step failed")
            for request_id in list(engine.scheduler.requests):
                engine.abort(request_id)
            conn.send(StepFailed(f"{type(exc).__name__}: {exc}"))
            if engine.failure is not None:
                _exit_fatal(conn, engine.failure)
            continue
        if outputs:
            conn.send(Outputs(outputs, engine.stats()))


def _apply(command: Command, conn: _LockedConnection, engine: LLMEngine) -> bool:
    """Applies one command; False for `Close`."""
    if isinstance(command, Add):
        try:
            engine.add_request(
                command.request_id, command.prompt, priority=command.priority, validated=command.validated
            )
        except ValueError as exc:
            conn.send(Refused(command.request_id, str(exc)))
    elif isinstance(command, Abort):
        output = engine.abort(command.request_id)
        if output is not None:
            conn.send(Outputs([output], engine.stats()))
    elif isinstance(command, Close):
        return False
    return True
