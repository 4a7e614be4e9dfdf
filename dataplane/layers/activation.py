"""SiLU(gate) * up over the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from modelfleet.dataplane.ops import get_op
from torch import nn


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * intermediate] = [gate | up]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("silu_and_mul", x.device.type)(x)

    forward_native = staticmethod(silu_and_mul_native)
