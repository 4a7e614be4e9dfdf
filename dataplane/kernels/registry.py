"""Makes the Triton kernels the "cuda" implementations of the model ops (modelfleet.dataplane.ops).

The signatures are those of the torch references in modelfleet.dataplane.layers. Registering needs
neither Triton nor a GPU (the kernel modules load on the first call), but is done only where both exist,
by `register_builtins` (modelfleet.dataplane.registration) at engine start.
"""

import torch
import torch.nn.functional as F
from modelfleet.dataplane.kernels.availability import triton_usable
from modelfleet.dataplane.ops import register_op, registered_ops

DEVICE_TYPE = "cuda"  # ROCm GPUs are torch "cuda" devices too, and Triton compiles for them
# Up to this many tokens the GEMV beats cuBLAS on the decode linears (bench/gemv.py, H100: 1.03 to 1.36x
# at 1 token); from 3 tokens on cuBLAS is faster, so larger batches keep F.linear.
GEMV_MAX_TOKENS = 2
GEMV_DTYPES = (torch.bfloat16, torch.float16)


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


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies x by weight with the GEMV (decode rows) rather than F.linear."""
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_MAX_TOKENS
        and x.is_cuda
        and weight.dtype in GEMV_DTYPES
        and x.dtype == weight.dtype
        and weight.is_contiguous()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if gemv_applies(x, weight):
        from modelfleet.dataplane.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "linear": linear,
}


def register_triton_ops(*, force: bool = False, keep: bool = False) -> bool:
    """Register every op of OPS for "cuda"; returns whether it did (only where Triton can run, unless
    forced). keep: an op that has a "cuda" implementation already keeps it."""
    if not (force or triton_usable()):
        return False
    present = registered_ops() if keep else {}
    for name, fn in OPS.items():
        if (name, DEVICE_TYPE) not in present:
            register_op(name, DEVICE_TYPE)(fn)
    return True
