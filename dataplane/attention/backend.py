"""The attention-backend interface and a registry of implementations by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from modelfleet.dataplane.attention.metadata import AttentionMetadata

# rotary(query, key, cos, sin) -> (query, key) rotated, e.g. a layers.RotaryEmbedding
RotaryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


class AttentionBackend(ABC):
    """Writes new K/V into a paged cache and computes attention reading K/V through block tables.

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 keys, 1 values), in the model's
    dtype or float8 e4m3 (kv_cache_dtype fp8: K / k_scale and V / v_scale are stored, see kv_quant.py).
    k_scale / v_scale are the layer's KV scales; a cache in the model's dtype ignores them.
    """

    name: str = ""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """key/value: [T, num_kv_heads, head_dim] -> kv_cache slots slot_mapping[T] (negative: skip)."""

    def rope_and_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rotary: RotaryFn,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query [T, Hq, D] and key [T, Hkv, D] by `rotary(query, key, cos, sin)`, writes the
        rotated key and value into kv_cache as write_kv does, and returns the rotated (query, key).
        Backends may fuse the two steps where they know what `rotary` computes."""
        query, key = rotary(query, key, cos, sin)
        self.write_kv(key, value, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return query, key

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        *,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query: [T, Hq, D] -> [T, Hq, D]. key/value (this step's, already written) are an optional hint
        a backend may use when no sequence has cached context. sliding_window W: keys at p-W+1..p only.
        out: where to write the result (its rows of the step's tokens), which is then returned."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def decorator(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return decorator


def available_backends() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def get_backend(name: str) -> AttentionBackend:
    cls = _BACKENDS.get(name)
    if cls is None:
        raise ValueError(
            f"attention backend {name!r} is not registered; available: {', '.join(available_backends())}"
        )
    return cls()
