"""Whether the Triton kernels can run here: Triton importable and a CUDA (or ROCm) device present."""

import functools
import importlib.util

import torch


@functools.cache
def triton_usable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
