"""A tensor-parallel worker (rank > 0): its main loop, and what its ModelRunner needs from rank 0.

The worker joins the group, builds a ModelRunner over its slice of the model, agrees on the number of
KV blocks with rank 0, then runs each step rank 0 sends through the pipe, in order, until "close". It
exits when rank 0's process is gone: the pipe ends (idle), a collective breaks (gloo), or the
lifeline, a pipe only rank 0 holds open, ends (a worker stuck in an NCCL collective).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch
from modelfleet.dataplane.parallel.group import TensorParallelGroup, worker_store
from torch import nn

logger = logging.getLogger(__name__)


class WorkerLink:
    """A worker's side of the start-up exchange with rank 0."""

    def __init__(self, group: TensorParallelGroup, conn: Connection) -> None:
        self.group = group
        self.device = group.device
        self.conn = conn

    def agree_num_blocks(self, capacity: int) -> int:
        """Sends this rank's KV-block capacity; rank 0 answers with the least over all ranks."""
        self.conn.send(("capacity", capacity))
        kind, *rest = self.conn.recv()
        if kind != "num_blocks":  # rank 0 gave up starting
            raise SystemExit(0)
        return rest[0]


class InputIdsFromFirstRank(nn.Module):
    """The model behind a decode CUDA graph of a tensor-parallel rank: the step's input ids (tokens in
    flight are sampled on rank 0 only) are broadcast from rank 0 inside the graph, before the model."""

    def __init__(self, model: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.model = model
        self.group = group
        self.attention_backend = model.attention_backend

    def forward(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        return self.model(self.group.broadcast(input_ids), *args)


def run_worker(
    conn: Connection,
    lifeline: Connection,
    rank: int,
    config: Any,
    max_model_len: int | None,
    device: str,
    port: int,
    environ: dict[str, str],
) -> None:
    """The worker process's main; it ends the process itself (os._exit), so no exit handler can hang
    on a group whose peers are gone."""
    os.environ.clear()
    os.environ.update(environ)
    from modelfleet.dataplane.observability import configure_logging

    configure_logging(logging.WARNING)
    threading.Thread(target=_exit_with_rank0, args=(lifeline,), name="lifeline", daemon=True).start()
    code = 0
    try:
        code = _run(conn, rank, config, max_model_len, torch.device(device), port)
    except SystemExit:
        pass
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        code = 1
    os._exit(code)


def _run(
    conn: Connection, rank: int, config: Any, max_model_len: int | None, device: torch.device, port: int
) -> int:
    from modelfleet.dataplane.engine.model_runner import ModelRunner

    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(("hello",))
    try:
        group = TensorParallelGroup(
            worker_store(port, config.tensor_parallel_size), rank, config.tensor_parallel_size, device
        )
        group.warm_up()
        runner = ModelRunner(config, max_model_len, link=WorkerLink(group, conn))
    except Exception as exc:  # rank 0 reports it as the engine's start-up error
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return 0
        if message[0] == "close":
            return 0
        runner.execute(message)


def _exit_with_rank0(lifeline: Connection) -> None:
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    os._exit(0)
