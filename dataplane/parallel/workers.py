"""Rank 0's side of a tensor-parallel engine: the worker processes of ranks 1..N-1.

Rank 0 lives in the engine's own process (its scheduler, sampler and KV-block bookkeeping run once,
there). It starts one process per other rank, each with a pipe: the start-up exchange and then every
step's host arrays go through it, pickled once and written to each worker, so an idle engine keeps no
collective waiting (a collective would time out). The ranks then meet in the model's collectives.

Liveness: a monitor thread waits on the workers' process sentinels. When one exits unexpectedly the
group fails: `failure` says which rank, the other workers are killed (so a collective waiting on them
breaks), and `on_failure` is called (an engine process exits on it: an NCCL collective waiting on a
dead rank would never return). Workers end with rank 0 (see worker.py), and close() stops them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from modelfleet.dataplane.parallel.group import TensorParallelGroup, master_store, set_collective_env
from modelfleet.dataplane.parallel.worker import run_worker

logger = logging.getLogger(__name__)

# Workers fork from a server process that has imported only these: torch's import (seconds) is paid
# once per engine process rather than once per rank, and nothing in it has touched CUDA.
_PRELOAD = ["torch", "numpy"]
_JOIN_SECONDS = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank could not start, or died."""


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: the CPU for all, or GPU (first + r) where rank 0 has GPU `first`."""
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ValueError(
            f"tensor_parallel_size: {size} needs CUDA GPUs (NCCL) or the CPU (gloo); {device} has neither"
        )
    first = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks from {device} need GPUs {first}..{first + size - 1}; "
            f"this node shows {count}"
        )
    return [torch.device("cuda", first + r) for r in range(size)]


class WorkerGroup:
    def __init__(self, config: Any, max_model_len: int | None, device: torch.device) -> None:
        size = config.tensor_parallel_size
        devices = rank_devices(device, size)
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])  # NCCL and the model's tensors on rank 0's own GPU
        set_collective_env()
        if multiprocessing.current_process().daemon:
            # An engine process is a daemon of the server's, which multiprocessing bars from having
            # children; its workers end with it (daemons themselves, plus their lifeline), so it may.
            multiprocessing.current_process().daemon = False
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._dead_lock = threading.Lock()  # _fail_dead's
        self._closing = False
        self._store = master_store(size)
        self.conns: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        # Closing the writer (at close, or when the group is collected) wakes the monitor to end.
        monitor_wake, stop_monitor = multiprocessing.Pipe(duplex=False)
        # Pipe ends closed at stop: the monitor's, then each worker's lifeline (its end tells it to exit).
        ends: list[Connection] = [stop_monitor]
        # Stops whatever has started, also when a later start fails.
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns, ends)
        for rank in range(1, size):
            conn, child_conn = context.Pipe()
            lifeline_in, lifeline = context.Pipe(duplex=False)
            process = context.Process(
                target=run_worker,
                args=(
                    child_conn,
                    lifeline_in,
                    rank,
                    config,
                    max_model_len,
                    str(devices[rank]),
                    self._store.port,
                    # The fork server's environment is that of its start: each worker takes rank 0's now.
                    dict(os.environ),
                ),
                name=f"modelfleet-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            lifeline_in.close()
            self.conns.append(conn)
            self.processes.append(process)
            ends.append(lifeline)
        try:
            for rank in range(1, size):
                self._expect(rank, "hello")
            self.group = TensorParallelGroup(self._store, 0, size, devices[0])
            self.group.warm_up()
        except BaseException:
            self.close()
            raise
        # The monitor holds the group weakly: a group nobody closed is still collected (and stopped).
        sentinels = [process.sentinel for process in self.processes]
        self._monitor = threading.Thread(
            target=_watch, args=(weakref.ref(self), sentinels, monitor_wake), name="tp-monitor", daemon=True
        )
        self._monitor.start()

    @property
    def device(self) -> torch.device:
        return self.group.device

    def _expect(self, rank: int, kind: str) -> Any:
        """The next start-up message of `rank`, which must be `kind`; TensorParallelError if the worker
        reports an error or exits first."""
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        wait([conn, process.sentinel])
        if conn.poll():
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("error", f"it exited with code {process.exitcode}")
            if message[0] == "error":
                raise TensorParallelError(f"tensor-parallel rank {rank} could not start: {message[1]}")
            if message[0] == kind:
                return message[1] if len(message) > 1 else None
        process.join(timeout=1)
        raise TensorParallelError(
            f"tensor-parallel rank {rank} exited with code {process.exitcode} while starting"
        )

    def agree_num_blocks(self, capacity: int) -> int:
        """The KV blocks every rank holds: the least any rank has room for."""
        capacities = [capacity] + [self._expect(rank, "capacity") for rank in range(1, len(self.conns) + 1)]
        num_blocks = min(capacities)
        for conn in self.conns:
            conn.send(("num_blocks", num_blocks))
        return num_blocks

    def send_step(self, message: tuple) -> None:
        data = bytes(ForkingPickler.dumps(message))
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:
            self.fail(f"a tensor-parallel rank stopped reading its steps ({exc})")
            raise TensorParallelError(self.failure) from exc

    def step_failed(self, exc: BaseException) -> None:
        """Rank 0's part of a step raised: the ranks are out of step for good. A collective breaks when
        a peer dies, so a dead worker is the likelier cause: it is named when there is one."""
        dead = wait([process.sentinel for process in self.processes], timeout=1.0)
        for rank, process in enumerate(self.processes, start=1):
            if process.sentinel in dead:
                self._fail_dead(rank)
                return
        self.fail(f"rank 0's step raised {type(exc).__name__}: {exc}")

    def _fail_dead(self, rank: int) -> None:
        # The monitor thread and a failed step may both get here: the fork server hands a worker's exit
        # status to one reader only (the other read would find the pipe closed, exit code 255).
        with self._dead_lock:
            if self.failure is not None:
                return
            process = self.processes[rank - 1]
            process.join(timeout=1)
            self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}")

    def fail(self, reason: str) -> None:
        """The group can run no more steps: records why, stops the workers, tells the owner (once)."""
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("tensor parallelism failed: %s", reason)
        for process in self.processes:
            if process.is_alive():
                process.kill()
        if self.on_failure is not None:
            self.on_failure(reason)

    def close(self) -> None:
        """Asks the workers to stop, then kills those that do not within a few seconds."""
        self._closing = True
        self._finalizer()


def _watch(group_ref: weakref.ref, sentinels: list[int], wake: Connection) -> None:
    ready = wait([*sentinels, wake])
    group = group_ref()
    if group is None or group._closing or wake in ready:
        return
    group._fail_dead(next(sentinels.index(s) + 1 for s in ready if s in sentinels))


def _stop(
    processes: list[multiprocessing.process.BaseProcess], conns: list[Connection], ends: list[Connection]
) -> None:
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(("close",))
    for process in processes:
        process.join(timeout=_JOIN_SECONDS)
        if process.is_alive():
            process.kill()
            process.join(timeout=_JOIN_SECONDS)
    for conn in [*conns, *ends]:
        conn.close()
