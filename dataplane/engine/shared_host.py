"""Host memory that the engine's helper processes map by name, pinned where the device copies out of it:
a grammar process fills a decode graph's bitmask input in place (engine/grammar_process.py), and the
graph's one copy of its inputs sends it on, with no copy between the processes' buffers.

A segment lives as long as the engine's process: it is removed at the process's exit (and by
multiprocessing's resource tracker if the process is killed)."""

from __future__ import annotations

import atexit
import logging
import mmap
import os
from multiprocessing.shared_memory import SharedMemory
from typing import NamedTuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Segments by their first byte's address: where a tensor lies (place_of).
_SEGMENTS: dict[int, SharedMemory] = {}


class Place(NamedTuple):
    """Where a tensor's memory lies in a shared segment."""

    name: str  # the segment's name (in /dev/shm)
    offset: int  # bytes from the segment's start


def shared_bytes(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """uint8 [nbytes] in a segment of its own; page-locked for the device's copies if `pinned`."""
    segment = SharedMemory(create=True, size=max(1, nbytes))
    memory = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
    if pinned:
        status = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes, 0)
        if int(status) != 0:
            segment.close()
            segment.unlink()
            raise RuntimeError(f"cudaHostRegister of {nbytes} shared bytes failed ({status})")
    _SEGMENTS[memory.data_ptr()] = segment
    return memory


def host_bytes(nbytes: int, *, pinned: bool, shared: bool) -> torch.Tensor:
    """uint8 [nbytes] on the host: in shared memory if `shared` and the host has it (else the process's
    own, said once in the log: a helper process then fills a buffer of its own, copied in)."""
    if shared:
        try:
            return shared_bytes(nbytes, pinned=pinned)
        except OSError as exc:
            logger.warning("a buffer helper processes write is not in shared memory (%s): copied in", exc)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def raise_to(cell: np.ndarray, number: int) -> None:
    """Writes `number` into a one-element counter unless it holds as much already: a release signal
    (kernels/host_signal.py), written by the engine or a helper process, never goes down."""
    if number > cell[0]:
        cell[0] = number


def set_flags(flags: np.ndarray, rows: list[int]) -> None:
    """Row flags of a step's bitmask: 1 for `rows` (masked), 0 for the others (sampling freely)."""
    flags[:] = 0
    flags[rows] = 1


def place_of(tensor: torch.Tensor) -> Place | None:
    """Where `tensor` lies, if in a segment made by shared_bytes."""
    address = tensor.data_ptr()
    for start, segment in _SEGMENTS.items():
        if start <= address < start + segment.size:
            return Place(segment.name, address - start)
    return None


def attach(name: str) -> mmap.mmap:
    """A segment mapped by its name, in another process. Mapped from its file, not through SharedMemory:
    that would have the mapping process's resource tracker remove the segment when that process ends
    (Python < 3.13)."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@atexit.register
def _remove_all() -> None:
    """The segments' names; their memory (and its page-locking) goes with the process."""
    for segment in _SEGMENTS.values():
        segment.unlink()
    _SEGMENTS.clear()
