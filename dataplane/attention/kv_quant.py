"""The fp8 KV cache (`kv_cache_dtype="fp8"`): float8 e4m3 cache tensors with a static scale per layer
for K and for V, as vLLM's `kv_cache_dtype=fp8`.

Written: x / scale, saturated to e4m3's range (+-448) and rounded to nearest; read: fp8 * scale. The
scales stay 1.0 unless a caller sets them (LlamaAttention.k_scale / v_scale): like vLLM without a
calibrated checkpoint. A scale measured from the first prefill's amax would depend on which request
came first, so two replicas (or one replica after a restart) would quantize the same prompt differently.
e4m3's relative precision (3 mantissa bits) is the same at every exponent, so a scale only matters for
values beyond +-448 (saturated) or below 2**-6 (subnormal); bench/kv_cache_fp8.py reports K/V's amax.
"""

from __future__ import annotations

import math

import torch
from modelfleet.dataplane.config import KV_CACHE_DTYPES
from modelfleet.dataplane.quantization import FP8_DTYPE as FP8_KV_DTYPE
from modelfleet.dataplane.quantization import FP8_MAX, fp8_supported


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


def check_scale(name: str, scale: float) -> float:
    """A KV scale must be a positive finite number (it divides every value written)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{name}: {scale!r} must be a number")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}: {scale!r} must be a positive finite number")
    return float(scale)


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated; the kernels multiply by the same float32 reciprocal."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    out = x.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What reading x back from an fp8 cache gives, in x's dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache tensors' dtype for the `kv_cache_dtype` setting: the model's ("auto") or e4m3 ("fp8").
    fp8 runs on CUDA GPUs of compute capability >= 8.9, and on the CPU (torch emulates the casts: half
    the cache memory, no speed)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return model_dtype
    # e4m3 arithmetic (casts and the Triton kernels' fp8 loads) needs Ada or Hopper and newer, as the fp8
    # weights' matmuls do.
    if device.type == "cpu" or fp8_supported(device):
        return FP8_KV_DTYPE
    where = str(device)
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    raise ValueError(
        f"kv_cache_dtype: fp8 needs a CUDA GPU with compute capability >= 8.9 (L4, H100, H200); {where} "
        "has none: use kv_cache_dtype auto"
    )
