"""A GPU engine's grammars in a process of their own: the schemas' compiles, one matcher per constrained
sequence, each step's accepts and the bitmask's fill, all away from the engine's interpreter lock.

Why a process: on the engine thread a constrained step added ~0.65 ms to a ~1.2-1.4 ms decode step of 64
rows (1B preset, H200), all of it held under the interpreter lock or spent handing work between threads:
the matchers' native accept (~2 us a row, the lock held: a thread cannot take it), the Python around it,
and the fill's handoff to its thread and back. Here the engine thread sends one message a step (each
constrained row's matcher slot and the tokens it follows) and, before the masked sampling is queued,
reads one reply (the rows still constrained). The process fills the bitmask, split over two threads of
its own (_SplitFill), straight into a decode graph's pinned input mirror, which lies in shared memory
(engine/shared_host.py); a buffer elsewhere (the eager sampler's) is filled in a shared one of this
process's and copied in.

Two socket pairs. Steps: the engine thread and the process's main thread, one message and one reply a
step, in order. Compiles: a thread at each end (the engine side's resolves the compile futures), so that a
compile never holds up a step. A matcher's slot opens with the step that first uses it and closes with
its sequence (RemoteGrammar's finalizer); both ride on the next step's message.

The process ends with the engine (its sockets close); if it dies first, the step waiting on it fails with
that error, and so does every compile still pending."""

from __future__ import annotations

import array
import contextlib
import itertools
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from modelfleet.dataplane.engine.shared_host import Place, attach, place_of, raise_to, set_flags, shared_bytes
from modelfleet.dataplane.engine.structured import (
    GrammarVocab,
    RemoteGrammar,
    bitmask_layout,
    compile_schema,
    due_tokens,
)

if TYPE_CHECKING:
    from modelfleet.dataplane.engine.sampler import SampledBatch
    from modelfleet.dataplane.engine.sequence import Sequence
    from modelfleet.dataplane.kernels.host_signal import MaskReady


# A step's message: rows in the batch, the number of the bitmask to fill, the signal number to release
# once it has filled (0: none), then how many (row, slot, token) entries, (slot, token) catch-ups, opened
# (slot, schema) and closed slots follow as int32, and the length of a new bitmask's description
# (_NEW_TARGET), at the end.
_HEADER = struct.Struct("<8i")
# A bitmask the process has not filled before: its number, offset in its segment and rows, the offsets of
# its row flags (in the same segment) and of its signal (kernels/host_signal.py), -1 where it has none;
# then the segment's name and the signal's segment's, a newline between.
_NEW_TARGET = struct.Struct("<5i")
# A reply that is an error, not the live rows: this, then the message in UTF-8.
_FAILED = -1
# Rows of bitmask the process's own buffer holds at least; it grows with the batch.
_MIN_ROWS = 64


class RemoteSchema(NamedTuple):
    """A schema compiled in a grammar process, under its key there."""

    process: GrammarProcess
    key: int
    vocab: GrammarVocab


class GrammarProcess:
    """The engine's side of a grammar process (see the module's docstring)."""

    def __init__(self, tokenizer_info: str, vocab: GrammarVocab, threads: int | str) -> None:
        """`tokenizer_info`: xgrammar's TokenizerInfo as JSON (the tokenizer's grammar vocabulary);
        `threads`: the fill's threads (structured.fill_threads)."""
        self._words = bitmask_layout(vocab).words
        self._own = self._own_buffer(_MIN_ROWS)  # first: no shared memory here, no process started
        # A fresh interpreter, not multiprocessing's spawn, which would import the engine's main module
        # again (a script without a main guard) and never a fork of a process that holds CUDA.
        steps_here, steps_there = socket.socketpair()
        compiles_here, compiles_there = socket.socketpair()
        fds = (steps_there.fileno(), compiles_there.fileno())
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, *map(str, fds)],
            pass_fds=fds,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        steps_there.close()
        compiles_there.close()
        self._steps = Connection(steps_here.detach())
        self._compiles = Connection(compiles_here.detach())
        self._compiles.send((tokenizer_info, vocab, threads))
        self.vocab = vocab
        self.threads = threads
        self._keys = itertools.count()
        self._slots = itertools.count()
        self._pending: dict[int, Future[RemoteSchema]] = {}
        self._lock = threading.Lock()  # _pending and the compile pipe's sends
        self._opened: list[int] = []  # slot, key pairs for the next step's message
        self._closed: deque[int] = deque()  # appended by finalizers, on any thread
        self._copy_from: torch.Tensor | None = None  # _own, where the step sent last filled it
        self._ready: MaskReady | None = None  # the step sent last's masked head, its flags and signal
        self._marks = False  # whether the process itself writes those
        # the bitmasks the process fills (and their flags and signals), by their number there
        self._targets: dict[tuple[Place, Place | None, Place | None], int] = {}
        self._new_target = b""  # the next message's: a target's number, offset, rows, segment name
        self._waiting = False
        threading.Thread(target=self._read_compiles, name="modelfleet-grammar-compiles", daemon=True).start()

    # Compiles: any thread.

    def compile(self, structured: tuple[str, str]) -> Future[RemoteSchema]:
        """The schema compiled in the process; the future fails with ValueError as Grammars.compile's."""
        future: Future[RemoteSchema] = Future()
        with self._lock:
            key = next(self._keys)
            self._pending[key] = future
            try:
                self._compiles.send(("compile", key, structured))
            except OSError:
                del self._pending[key]
                future.set_exception(RuntimeError(self.ended()))
        return future

    def forget(self, schema: RemoteSchema) -> None:
        """Drops a compiled schema (a cache's eviction); the matchers made from it keep it alive."""
        with self._lock, contextlib.suppress(OSError):  # ended: nothing to drop
            self._compiles.send(("forget", schema.key, None))

    def _read_compiles(self) -> None:
        while True:
            try:
                key, error = self._compiles.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(key)
            if error is None:
                future.set_result(RemoteSchema(self, key, self.vocab))
            else:
                future.set_exception(ValueError(error))
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(RuntimeError(self.ended()))

    # Matchers and steps: the engine thread.

    def open(self, schema: RemoteSchema) -> RemoteGrammar:
        """A fresh matcher for one sequence; the process makes it with the next step's message."""
        slot = next(self._slots)
        self._opened += (slot, schema.key)
        return RemoteGrammar(self, slot, schema.vocab)

    def release(self, slot: int) -> None:
        self._closed.append(slot)

    def start(
        self,
        seqs: list[Sequence],
        previous: SampledBatch | None,
        num_rows: int,
        host: torch.Tensor,
        ready: MaskReady | None = None,
    ) -> None:
        """Sends a step: each constrained row's slot and the tokens its matcher has not followed yet (a
        token in flight read from `previous`: structured.due_tokens), and where the bitmask goes:
        `host` (int32 [>= num_rows, words]) itself where it lies in shared memory (shared_host: a
        decode graph's input mirror), else a buffer of this process's that `wait` copies from. With
        `ready` (a masked head's: `host` is its bitmask), its row flags are written and its signal
        released once the bitmask has filled: by the process where they lie in shared memory, else by
        `wait` (a step that fails is the runner's to release: ModelRunner._launch_graph_masked). One step
        at a time: `wait` ends it."""
        if self._waiting:  # a step dropped before its wait: its reply (and any error) goes with it
            with contextlib.suppress(RuntimeError):
                self._reply()
        self._send(seqs, previous, num_rows, host, ready)
        self._ready = ready
        self._waiting = True

    def _send(
        self,
        seqs: list[Sequence],
        previous: SampledBatch | None,
        num_rows: int,
        host: torch.Tensor,
        ready: MaskReady | None,
    ) -> None:
        entries: list[int] = []  # row, slot, token (-1: none to follow)
        catch_up: list[int] = []  # slot, token: known tokens a row is behind on, before its entry's
        for i, grammar, behind, token in due_tokens(seqs, previous):
            for t in behind:
                catch_up += (grammar.slot, t)
            entries += (i, grammar.slot, token)
        target = self._target(host, num_rows, ready)
        opened, self._opened = self._opened, []
        closed = [self._closed.popleft() for _ in range(len(self._closed))]
        new_target, self._new_target = self._new_target, b""
        header = _HEADER.pack(
            num_rows,
            target,
            ready.number if ready is not None and self._marks else 0,
            len(entries) // 3,
            len(catch_up) // 2,
            len(opened) // 2,
            len(closed),
            len(new_target),
        )
        body = array.array("i", entries + catch_up + opened + closed).tobytes()
        try:
            self._steps.send_bytes(header + body + new_target)
        except OSError:
            raise RuntimeError(self.ended()) from None

    def wait(self, host: torch.Tensor) -> list[int]:
        """Ends the step sent last: the rows still constrained, their bitmask rows in `host` (start's; the
        other rows left as they are), and its masked head's flags and signal (start's `ready`) written.
        RuntimeError with the process's error."""
        rows = self._reply()
        source, self._copy_from = self._copy_from, None
        if rows and source is not None:
            host.numpy()[rows] = source.numpy()[rows]
        ready, self._ready = self._ready, None
        if ready is not None and not self._marks:
            ready.mark(rows)
        return rows

    def _reply(self) -> list[int]:
        self._waiting = False
        try:
            reply = self._steps.recv_bytes()
        except (EOFError, OSError):
            raise RuntimeError(self.ended()) from None
        values = np.frombuffer(reply, dtype=np.int32, count=len(reply) // 4)
        if len(values) and values[0] == _FAILED:
            raise RuntimeError(f"structured output: {reply[4:].decode()}")
        return values.tolist()

    def _target(self, host: torch.Tensor, num_rows: int, ready: MaskReady | None) -> int:
        """The number of the bitmask the process fills this step: `host` where shared, else _own (which
        `wait` copies from); with `ready`'s flags and signal where they are shared too (_marks)."""
        place = place_of(host)
        self._copy_from = None
        if place is None or not host.is_contiguous():
            if self._own.shape[0] < num_rows:  # grown by doubling: each buffer stays mapped
                self._own = self._own_buffer(max(num_rows, 2 * self._own.shape[0]))
            host = self._copy_from = self._own
            place = place_of(host)
            assert place is not None  # made shared
        flags = signal = None
        if ready is not None and self._copy_from is None:
            flags, signal = place_of(ready.flags), ready.signal.place
            if flags is None or signal is None or flags.name != place.name:
                flags = signal = None
        self._marks = signal is not None
        key = (place, flags, signal)
        number = self._targets.get(key)
        if number is None:
            number = self._targets[key] = len(self._targets)
            offsets = (-1 if flags is None else flags.offset, -1 if signal is None else signal.offset)
            names = f"{place.name}\n{'' if signal is None else signal.name}"
            self._new_target = (
                _NEW_TARGET.pack(number, place.offset, host.shape[0], *offsets) + names.encode()
            )
        return number

    def _own_buffer(self, rows: int) -> torch.Tensor:
        """A bitmask of this process's in shared memory (int32 [rows, words]), for hosts outside it."""
        return shared_bytes(rows * self._words * 4, pinned=False).view(torch.int32).view(rows, self._words)

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def ended(self) -> str:
        """What to say of a process that ended."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=1)
        return f"structured output: the grammar process ended (exit code {self._process.returncode})"

    def close(self) -> None:
        for conn in (self._steps, self._compiles):
            conn.close()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


# The process's side.


def _serve(steps: Connection, compiles: Connection) -> None:
    import xgrammar

    tokenizer_info, vocab, threads = compiles.recv()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(tokenizer_info))
    compiled: dict[int, Any] = {}
    threading.Thread(target=_compile_loop, args=(compiles, compiler, compiled), daemon=True).start()
    fill = _SplitFill(xgrammar, SPLIT_THREADS if threads == "auto" else threads)
    accept = xgrammar.base._core.BatchGrammarMatcher.batch_accept_token  # as structured._accept_tokens
    matchers: dict[int, Any] = {}
    words = bitmask_layout(vocab).words
    segments: dict[str, mmap.mmap] = {}
    targets: dict[int, _Target] = {}  # the bitmasks to fill, by their numbers (GrammarProcess._target)

    def mapped(name: str) -> mmap.mmap:
        return segments.get(name) or segments.setdefault(name, attach(name))

    while True:
        try:
            message = steps.recv_bytes()
        except (EOFError, OSError):
            return
        header = _HEADER.unpack_from(message)
        num_rows, target, release, n_entries, n_catch_up, n_opened, n_closed, n_new = header
        end = len(message) - n_new
        values = np.frombuffer(message, dtype=np.int32, offset=_HEADER.size, count=(end - _HEADER.size) // 4)
        entries = values[: 3 * n_entries].reshape(-1, 3).tolist()
        at = 3 * n_entries
        catch_up = values[at : at + 2 * n_catch_up].tolist()
        at += 2 * n_catch_up
        opened = values[at : at + 2 * n_opened].tolist()
        closed = values[at + 2 * n_opened : at + 2 * n_opened + n_closed].tolist()
        # The matchers' comings and goings first, whatever becomes of the step: none is lost with it.
        for slot, key in zip(opened[::2], opened[1::2], strict=True):
            if key in compiled:  # else the slot's rows fail below, naming it
                matchers[slot] = xgrammar.GrammarMatcher(compiled[key])
        for slot in closed:  # after the opens: a sequence may end before its first step
            matchers.pop(slot, None)
        try:
            if n_new:
                number, offset, rows, flags_at, signal_at = _NEW_TARGET.unpack_from(message, end)
                name, signal_name = message[end + _NEW_TARGET.size :].decode().split("\n")
                segment = mapped(name)
                view = torch.frombuffer(segment, dtype=torch.int32, count=rows * words, offset=offset)
                flags = None if flags_at < 0 else np.frombuffer(segment, np.int32, rows, flags_at)
                signal = None if signal_at < 0 else np.frombuffer(mapped(signal_name), np.int64, 1, signal_at)
                targets[number] = _Target(view.view(rows, words), flags, signal)
            for slot, token in zip(catch_up[::2], catch_up[1::2], strict=True):
                _matcher(matchers, slot).accept_token(vocab.grammar_id(token))  # a rejected one is ignored
            handles, tokens = [], []
            for _, slot, token in entries:
                if token >= 0:
                    handles.append(_matcher(matchers, slot)._handle)
                    tokens.append(vocab.grammar_id(token))
            if handles:
                accept(handles, tokens, False)
            rows = [(row, _matcher(matchers, slot)) for row, slot, _ in entries]
            live = [(row, matcher) for row, matcher in rows if not matcher.is_terminated()]
            live_rows = [row for row, _ in live]
            into = targets[target]
            if live:
                fill([m for _, m in live], into.bits[:num_rows], live_rows)
            reply = np.array(live_rows, dtype=np.int32).tobytes()
            if into.flags is not None:
                set_flags(into.flags, live_rows)
        except Exception as exc:  # the engine's step fails with it; the process goes on
            reply = np.array([_FAILED], dtype=np.int32).tobytes() + f"{type(exc).__name__}: {exc}".encode()
        if release:  # after the bitmask and the flags: the masked head copies them once released
            filled = targets.get(target)
            if filled is not None and filled.signal is not None:
                raise_to(filled.signal, release)
        steps.send_bytes(reply)


class _Target(NamedTuple):
    """A bitmask the process fills, and where it has them, its row flags and signal."""

    bits: torch.Tensor
    flags: np.ndarray | None
    signal: np.ndarray | None


def _matcher(matchers: dict[int, Any], slot: int) -> Any:
    matcher = matchers.get(slot)
    if matcher is None:
        raise ValueError(f"no matcher in slot {slot} (its schema not compiled here, or its sequence ended)")
    return matcher


# Threads filling a step's bitmask in the process, "auto"'s: see _SplitFill.
SPLIT_THREADS = 2


class _SplitFill:
    """A step's bitmask filled by `threads` threads at once (this one among them), each over every
    threads-th row with a single-threaded xgrammar filler. xgrammar's own pool (a BatchGrammarMatcher of
    several threads) cost more than it shared out: 64 rows of bench/serve.py's records schema filled in
    1.00 ms on one thread, 0.81 / 0.65 / 1.03 ms on xgrammar's 2 / 4 / 8, and 0.35 / 0.53 / 0.51 ms split
    here over 2 / 4 / 8 (an H200 host's vCPUs; a few rows cost ~250 us, most ~3 us; bench/grammar_fill.py)."""

    def __init__(self, xgrammar: Any, threads: int) -> None:
        self._fillers = [xgrammar.BatchGrammarMatcher(max_threads=1) for _ in range(threads)]
        self._jobs: list[Any] = [None] * threads
        self._errors: list[Exception | None] = [None] * threads
        self._started = [threading.Lock() for _ in range(threads)]
        self._ended = [threading.Lock() for _ in range(threads)]
        for i in range(1, threads):
            self._started[i].acquire()
            self._ended[i].acquire()
            threading.Thread(target=self._run, args=(i,), daemon=True).start()

    def __call__(self, matchers: list[Any], bitmask: Any, rows: list[int]) -> None:
        step = min(len(self._fillers), len(rows))
        for i in range(1, step):
            self._jobs[i] = (matchers[i::step], bitmask, rows[i::step])
            self._started[i].release()
        error: Exception | None = None
        try:
            self._fillers[0].batch_fill_next_token_bitmask(matchers[::step], bitmask, indices=rows[::step])
        except Exception as exc:
            error = exc
        for i in range(1, step):
            self._ended[i].acquire()
            error, self._errors[i] = error or self._errors[i], None
        if error is not None:
            raise error

    def _run(self, i: int) -> None:
        while True:
            self._started[i].acquire()
            matchers, bitmask, rows = self._jobs[i]
            try:
                self._fillers[i].batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
            except Exception as exc:  # raised by the call that shared the fill out
                self._errors[i] = exc
            self._ended[i].release()


def _compile_loop(compiles: Connection, compiler: Any, compiled: dict[int, Any]) -> None:
    while True:
        try:
            kind, key, structured = compiles.recv()
        except (EOFError, OSError):
            return
        if kind == "forget":
            compiled.pop(key, None)
            continue
        try:
            compiled[key] = compile_schema(compiler, structured)
            error = None
        except ValueError as exc:
            error = str(exc)
        compiles.send((key, error))


if __name__ == "__main__":  # GrammarProcess's child: the two socket ends it was given
    # Ctrl-C reaches the whole process group: it stops the server, whose engine closes these sockets.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(*(Connection(int(fd)) for fd in sys.argv[1:3]))
