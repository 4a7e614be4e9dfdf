"""Host data onto the engine's device without waiting for the device."""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` (a numpy array or CPU tensor) on `device`, queued behind the device's work. A copy from
    pageable memory may wait for the stream to drain (CUDA stages it through a driver buffer, "the driver
    may synchronize with the stream"), which makes a step launched ahead wait for the one before it; a
    copy from pinned memory never does. PyTorch's pinned-block cache keeps each block until the copy
    that read it has run."""
    tensor = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
