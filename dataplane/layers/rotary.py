"""Rotary position embedding (default, linear and Llama 3 scaling), numerically as in Hugging Face."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from modelfleet.dataplane.ops import get_op
from torch import nn

if TYPE_CHECKING:  # layers/ must not import models/ at run time (models/ imports layers/)
    from modelfleet.dataplane.models.config import RopeConfig


def compute_inv_freq(head_dim: int, rope: RopeConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with the same float ops as transformers."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_embedding_native(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], cos/sin: [T, D/2] in q's dtype (neox layout: halves rotate)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin once per step (shared by all layers) and applies them to q and k."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        # Not a checkpoint tensor: always computed, on the CPU here and moved by `to_device`.
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, rope, "cpu"), persistent=False)

    def to_device(self, device: torch.device) -> None:
        self.inv_freq = compute_inv_freq(self.head_dim, self.rope, device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, D/2] in dtype (computed in float32 first, as HF does)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return get_op("rotary_embedding", q.device.type)(q, k, cos, sin)

    forward_native = staticmethod(rotary_embedding_native)
