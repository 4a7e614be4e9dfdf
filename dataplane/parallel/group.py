"""A rank's collectives over the tensor-parallel group: gloo on the CPU, NCCL on GPUs.

The group is a process group object of its own, never torch.distributed's global default: a server
process may hold several engines, each with its own group. Collectives run in place and queue on the
current stream, so on GPUs they are captured into CUDA graphs like any other kernel.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

# Collectives wait at most this long for a slow rank; a rank that died breaks them sooner (gloo) or is
# caught by rank 0's monitor (see workers.py).
TIMEOUT = datetime.timedelta(minutes=10)
HOST = "127.0.0.1"  # the ranks of one engine are processes of one node

# NVLink multicast (NVLS) and torch's multicast symmetric memory stay off: not every node's fabric
# manager provides them, and an all-reduce that needs them fails only at run time. Collectives keep
# their tensors alive without recordStream, which would tie graph-pool memory to NCCL's stream.
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
}


def set_collective_env() -> None:
    """Before any group exists in this process (workers inherit it)."""
    os.environ.update(NCCL_ENV)


class TensorParallelGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        store = dist.PrefixStore("modelfleet-tp", store)
        if device.type == "cuda":
            set_collective_env()
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.backend = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.backend = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)
        self._broadcast_options = dist.BroadcastOptions()
        self._broadcast_options.rootRank = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns `tensor`."""
        self.backend.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's values into every rank's `tensor`, in place; returns it."""
        self.backend.broadcast([tensor], self._broadcast_options).wait()
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last dimension (ranks in order)."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.backend.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)

    def warm_up(self) -> None:
        """One collective: NCCL builds its communicator on the first, which must not happen during a
        CUDA graph capture."""
        self.all_reduce(torch.zeros(1, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        """Releases the group's connections (NCCL communicators); the group is unusable afterwards."""
        # RuntimeError: a group a dead rank broke; AttributeError: a backend without shutdown.
        with contextlib.suppress(RuntimeError, AttributeError):
            self.backend.shutdown()


def master_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (`store.port`)."""
    return dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def worker_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, size, is_master=False, timeout=TIMEOUT)
