"""Makes the Triton kernels the "cuda" implementations of the model ops (modelfleet.dataplane.ops).

The signatures are those of the torch references in modelfleet.dataplane.layers. Registering needs
neither Triton nor a GPU (the kernel modules load on the first call), but is done only where both exist.
"""

import torch
from modelfleet.dataplane.kernels.availability import triton_usable
from modelfleet.dataplane.ops import register_op

DEVICE_TYPE = "cuda"  # ROCm GPUs are torch "cuda" devices too, and Triton compiles for them


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from modelfleet.dataplane.kernels.rms_norm import rms_norm as kernel

    return kernel(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from modelfleet.dataplane.kernels.rms_norm import rms_norm as kernel

    return kernel(x, weight, eps, residual)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from modelfleet.dataplane.kernels.rotary import rotary_embedding as kernel

    return kernel(q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from modelfleet.dataplane.kernels.activation import silu_and_mul as kernel

    return kernel(x)


OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
}


def register_triton_ops(*, force: bool = False) -> bool:
    """Register every op of OPS for "cuda"; returns whether it did (only where Triton can run)."""
    if not (force or triton_usable()):
        return False
    for name, fn in OPS.items():
        register_op(name, DEVICE_TYPE)(fn)
    return True
