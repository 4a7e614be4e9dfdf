"""RMSNorm, with a variant that first adds the residual (one pass over the activations)."""

from __future__ import annotations

import torch
from modelfleet.dataplane.ops import get_op
from torch import nn


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as Hugging Face: normalize in float32, cast back, then scale.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm_native(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = residual + x
    return rms_norm_native(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return get_op("rms_norm", x.device.type)(x, self.weight, self.eps)
        return get_op("fused_add_rms_norm", x.device.type)(x, residual, self.weight, self.eps)

    forward_native = staticmethod(rms_norm_native)
