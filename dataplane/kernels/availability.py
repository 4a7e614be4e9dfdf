"""Whether the Triton kernels can run here: Triton importable and a CUDA (or ROCm) device present; and
whether they may use programmatic dependent launch. Imports no Triton, so it is safe on any machine."""

import functools
import importlib.util
import os

import torch

PDL_ENV = "MODELFLEET_PDL"  # "0" (or false/off/no) turns programmatic dependent launch off


@functools.cache
def triton_usable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available()


@functools.cache
def _pdl_allowed_by_env() -> bool:
    return os.environ.get(PDL_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel scheduled while its predecessor drains; it waits with
    `gdc_wait` before reading that predecessor's output) needs an NVIDIA GPU of compute capability 9.0
    (Hopper) or newer, and is on unless MODELFLEET_PDL=0 (the variable is read once per process)."""
    return _pdl_allowed_by_env() and nvidia_gpu(device) and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def nvidia_gpu(device: torch.device) -> bool:
    """An NVIDIA GPU, where kernels may use PTX (inline assembly) and libdevice: not ROCm, and not Triton's
    interpreter on the CPU."""
    return device.type == "cuda" and torch.version.hip is None


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
