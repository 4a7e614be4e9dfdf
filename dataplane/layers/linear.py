"""Linear layers. MergedLinear holds several checkpoint projections (q/k/v, gate/up) as one matmul.

`make_linear` builds the right kind for a checkpoint: float, or quantized (int8/fp8 weights with
per-channel scales, modelfleet.dataplane.quantization). A fused module carries `part_names` and
`part_sizes` so the loader can assemble it from the checkpoint's separate tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from modelfleet.dataplane.ops import get_op
from modelfleet.dataplane.quantization import QuantizedLinear
from torch import nn


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x @ W.T + b with W: [out_features, in_features] (the checkpoint layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("linear", x.device.type)(x, self.weight, self.bias)

    forward_native = staticmethod(linear_native)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim: one matmul instead of many.

    `part_names` are the checkpoint module names of the parts, in stacking order.
    """

    def __init__(self, in_features: int, part_sizes: list[int], part_names: list[str], bias: bool = False):
        super().__init__(in_features, sum(part_sizes), bias)
        self.part_sizes = list(part_sizes)
        self.part_names = list(part_names)


def make_linear(
    in_features: int,
    part_sizes: list[int],
    part_names: list[str] | None = None,
    *,
    bias: bool = False,
    quant_format: str | None = None,
) -> nn.Module:
    """One projection (a single part) or several fused ones (part_names given), float or quantized."""
    if quant_format is None:
        if part_names is None:
            return Linear(in_features, sum(part_sizes), bias)
        return MergedLinear(in_features, part_sizes, part_names, bias)
    module = QuantizedLinear(in_features, sum(part_sizes), bias, quant_format)
    if part_names is not None:
        module.part_sizes = list(part_sizes)
        module.part_names = list(part_names)
    return module
