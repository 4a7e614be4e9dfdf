"""A small device layer: which platform we run on, its default dtype, attention backend and memory.

Platforms: cuda (NVIDIA), rocm (AMD, also torch.device("cuda")), xpu (Intel), mps (Apple), cpu.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from modelfleet.dataplane.kernels.availability import triton_usable

PLATFORMS: tuple[str, ...] = ("cuda", "rocm", "xpu", "mps", "cpu")
# Env override of the CPU serving dtype: "float32" or "bfloat16" (see default_dtype for the measurement).
CPU_DTYPE_ENV = "MODELFLEET_CPU_DTYPE"
# Env override of the number of CPU threads torch computes with (see cpu_threads).
CPU_THREADS_ENV = "MODELFLEET_CPU_THREADS"


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int
    free_bytes: int


def platform_of(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    if device.type in ("xpu", "mps", "cpu"):
        return device.type
    raise ValueError(f"device {device}: unsupported device type; supported platforms: {', '.join(PLATFORMS)}")


def detect_device() -> torch.device:
    """The best accelerator present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", 0)
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """'auto'/None -> detect_device(); otherwise a torch.device, checked to be usable."""
    if name is None or name == "auto":
        return detect_device()
    device = torch.device(name)
    platform_of(device)
    available = {
        "cuda": torch.cuda.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
        "mps": torch.backends.mps.is_available,
        "cpu": lambda: True,
    }[device.type]
    if not available():
        raise ValueError(f"device {device}: not available on this machine; use 'cpu' or 'auto'")
    return device


def supports_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "xpu":
        return True
    if device.type == "mps":
        return True  # macOS 14+; older systems fail loudly at first use
    return True


def cpu_has_native_bf16() -> bool:
    """x86 with AVX512-BF16 or AMX, or Arm with the BF16 extension (read from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPUs that have it, fp16 on older GPUs. On the CPU: bf16 where the CPU computes it natively,
    else float32; MODELFLEET_CPU_DTYPE (float32 | bfloat16) overrides.

    Measured with the ~100M-parameter demo Llama ("small") on an AMD EPYC with AVX512-BF16, one thread:
    prefill of 512 tokens 3.5 s in float32 vs 0.88 s in bf16; a decode step of 64 sequences (context
    16..512) 1.59 s vs 0.52 s. Without native bf16 the conversions make bf16 the slower one.
    """
    device = torch.device(device)
    if device.type == "cpu":
        choice = os.environ.get(CPU_DTYPE_ENV)
        if choice is None:
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if choice not in dtypes:
            raise ValueError(f"{CPU_DTYPE_ENV}={choice!r}: expected one of {', '.join(dtypes)}")
        return dtypes[choice]
    return torch.bfloat16 if supports_bf16(device) else torch.float16


def attention_backend_name(device: torch.device | str) -> str:
    """The attention backend for a device: the Triton kernels on CUDA/ROCm where Triton runs, else torch."""
    if platform_of(device) in ("cuda", "rocm") and triton_usable():
        return "triton"
    return "torch"


def memory_info(device: torch.device | str) -> MemoryInfo:
    """Total and free memory of the device (host RAM for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryInfo(total_bytes=total, free_bytes=free)
    if device.type == "xpu":
        total = torch.xpu.get_device_properties(device).total_memory
        return MemoryInfo(total_bytes=total, free_bytes=total - torch.xpu.memory_reserved(device))
    if device.type == "mps":
        total = psutil.virtual_memory().total  # unified memory
        return MemoryInfo(total_bytes=total, free_bytes=total - torch.mps.driver_allocated_memory())
    vm = psutil.virtual_memory()
    return MemoryInfo(total_bytes=vm.total, free_bytes=vm.available)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (a pod's CPU limit)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, count)


def cpu_threads() -> int:
    """Threads for CPU compute: MODELFLEET_CPU_THREADS, else the usable CPUs that other work leaves idle.

    OpenMP threads that share cores with other busy processes spend their time waiting for each other:
    on the 2-core CI machine under a load of ~6, a decode step of the demo model took 0.6-0.9 s with one
    thread and 2.6-2.9 s with two. So cores already busy (the 1-minute load average) are left out.
    """
    override = os.environ.get(CPU_THREADS_ENV)
    if override is not None:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"{CPU_THREADS_ENV}={override!r}: expected a positive integer")
        return int(override)
    cpus = usable_cpus()
    busy = int(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cpus, cpus - busy))


def configure_cpu_threads() -> int:
    """Set torch's intra-op thread count from cpu_threads(); returns it. Call once at engine start."""
    threads = cpu_threads()
    torch.set_num_threads(threads)
    return threads


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
