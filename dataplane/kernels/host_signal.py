"""A number in pinned host memory that the device waits on: a kernel queued (or captured in a CUDA graph)
spins until the host has written at least the number it waits for, then lets the stream go on.

Why: a constrained decode step's sampling needs its grammars' bitmask, which fills on the host while the
device runs the step's forward. Waited for on the host, the sampling could only be queued once the fill
had ended, and the next step's forward only after it: the device idled while the engine thread planned
and processed. Waited for on the device, the engine queues the forward, the sampling and the next step at
once, and whoever fills the bitmask (a grammar process, a fill thread) writes the number when it is done
(engine/model_runner.py: ModelRunner._launch_graph_masked; kernels/cuda_graphs.py: MaskedHeadGraphs).

The numbers only grow: the k-th wait queued waits for k (the device counts its waits itself, so a graph
replays the same kernel every time), and writing a number releases every wait up to it. A wait that is
never released hangs the stream, so each one queued is released: by its filler once the bitmask has
filled, or by the engine's runner where the step failed or was dropped (`release`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from modelfleet.dataplane.engine.shared_host import host_bytes, place_of, raise_to, set_flags


@triton.jit
def _wait_kernel(signal_ptr, waited_ptr):
    target = tl.load(waited_ptr) + 1
    seen = tl.load(signal_ptr, volatile=True)
    while seen < target:
        seen = tl.load(signal_ptr, volatile=True)
    tl.store(waited_ptr, target)


class HostSignal:
    """One signal: an int64 in pinned host memory (shared with helper processes where the host has shared
    memory: engine/shared_host.py), read by the device through its mapping of that memory."""

    def __init__(self, device: torch.device) -> None:
        with torch.inference_mode(False):
            memory = host_bytes(8, pinned=device.type == "cuda", shared=True)
        self.host = memory.view(torch.int64)
        self.host.zero_()
        self._value = self.host.numpy()
        self.place = place_of(self.host)  # None: not shared, written by this process alone
        self.device_view = _mapped(self.host, device)
        self._waited = torch.zeros(1, dtype=torch.int64, device=device)  # the device's count of its waits
        self.queued = 0  # the host's count of the waits queued
        if device.type == "cuda":  # one wait run now: its kernel compiles here, not while a graph captures
            self.release(self.queue())
            self.wait()

    def wait(self) -> None:
        """Queues a wait on the current stream (capturable: a graph's replay waits for the next number)."""
        _wait_kernel[(1,)](self.device_view, self._waited)

    def queue(self) -> int:
        """Counts a wait just queued (or a graph's replay that holds one); the number that releases it."""
        self.queued += 1
        return self.queued

    def release(self, number: int) -> None:
        """Releases every wait up to `number` (never lowers the signal)."""
        raise_to(self._value, number)

    def release_all(self) -> None:
        self.release(self.queued)


class MaskReady(NamedTuple):
    """Where a step's bitmask goes and how its sampling learns it has filled: the bitmask rows and row
    flags (1: masked) in pinned host memory that the sampling copies after its wait, and the number that
    releases that wait. The filler writes the bitmask, then the flags, then the number (`mark`)."""

    bits: torch.Tensor  # int32 [>= rows, words]
    flags: torch.Tensor  # int32 [>= rows]
    signal: HostSignal
    number: int

    def flag(self, rows: list[int]) -> None:
        """The row flags: `rows` masked, the others sampling freely."""
        set_flags(self.flags.numpy(), rows)

    def release(self) -> None:
        self.signal.release(self.number)

    def mark(self, rows: list[int]) -> None:
        """The flags of a step whose bitmask has filled in `rows`, then the signal."""
        self.flag(rows)
        self.release()


def _mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (page-locked) as a tensor on `device`: the same memory, through the device's mapping of it
    (unified addressing). Checked by reading a value back, since a device that cannot map it would read
    something else."""
    if device.type != "cuda":
        return host
    interface: dict[str, Any] = {
        "shape": tuple(host.shape),
        "typestr": np.dtype(np.int64).str,
        "data": (host.data_ptr(), False),
        "version": 3,
    }
    view = torch.as_tensor(_Interface(interface), device=device)
    host.fill_(0x5EED)
    if int(view[0].item()) != 0x5EED:
        raise RuntimeError("the device does not read pinned host memory through its mapping")
    host.zero_()
    return view


class _Interface:
    def __init__(self, interface: dict[str, Any]) -> None:
        self.__cuda_array_interface__ = interface
