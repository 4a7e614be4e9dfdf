"""The device layer on this (CPU) machine, and the GPU choices it makes where it can be checked."""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane import device as dev


def test_cpu_platform_and_defaults(monkeypatch):
    monkeypatch.delenv(dev.CPU_DTYPE_ENV, raising=False)
    assert dev.platform_of("cpu") == "cpu"
    monkeypatch.setattr(dev, "cpu_has_native_bf16", lambda: True)
    assert dev.default_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(dev, "cpu_has_native_bf16", lambda: False)
    assert dev.default_dtype("cpu") == torch.float32
    assert dev.attention_backend_name("cpu") == "torch"
    assert dev.resolve_device("cpu") == torch.device("cpu")


def test_cpu_dtype_override(monkeypatch):
    monkeypatch.setattr(dev, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setenv(dev.CPU_DTYPE_ENV, "float32")
    assert dev.default_dtype("cpu") == torch.float32
    monkeypatch.setenv(dev.CPU_DTYPE_ENV, "float64")
    with pytest.raises(ValueError, match=dev.CPU_DTYPE_ENV):
        dev.default_dtype("cpu")


def test_detect_device_without_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    if hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert dev.detect_device() == torch.device("cpu")
    assert dev.resolve_device("auto") == torch.device("cpu")


def test_unavailable_device_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="not available"):
        dev.resolve_device("cuda")


def test_gpu_dtype_follows_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert dev.default_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert dev.default_dtype("cuda") == torch.float16  # e.g. a T4


def test_rocm_is_told_apart_from_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert dev.platform_of("cuda") == "rocm"
    monkeypatch.setattr(torch.version, "hip", None)
    assert dev.platform_of("cuda") == "cuda"


def test_triton_backend_is_picked_where_triton_runs(monkeypatch):
    monkeypatch.setattr(dev, "triton_usable", lambda: False)
    assert dev.attention_backend_name("cuda") == "torch"
    monkeypatch.setattr(dev, "triton_usable", lambda: True)
    assert dev.attention_backend_name("cuda") == "triton"
    assert dev.attention_backend_name("cpu") == "torch"


def test_cpu_memory_info():
    info = dev.memory_info("cpu")
    assert 0 < info.free_bytes <= info.total_bytes


def test_cpu_threads_leave_busy_cores_out(monkeypatch):
    monkeypatch.delenv(dev.CPU_THREADS_ENV, raising=False)
    monkeypatch.setattr(dev, "usable_cpus", lambda: 8)
    monkeypatch.setattr(dev.os, "getloadavg", lambda: (2.4, 0.0, 0.0))
    assert dev.cpu_threads() == 6
    monkeypatch.setattr(dev.os, "getloadavg", lambda: (30.0, 0.0, 0.0))
    assert dev.cpu_threads() == 1
    monkeypatch.setenv(dev.CPU_THREADS_ENV, "3")
    assert dev.cpu_threads() == 3
    monkeypatch.setenv(dev.CPU_THREADS_ENV, "zero")
    with pytest.raises(ValueError, match=dev.CPU_THREADS_ENV):
        dev.cpu_threads()


def test_usable_cpus_is_positive_and_bounded():
    assert 1 <= dev.usable_cpus() <= (dev.os.cpu_count() or 1)
