"""Attention backends behind one interface; `get_backend(name)` returns one ("torch" always exists)."""

from modelfleet.dataplane.attention import torch_paged as _torch_paged  # noqa: F401  (registers "torch")
from modelfleet.dataplane.attention.backend import (
    AttentionBackend,
    available_backends,
    get_backend,
    register_backend,
)
from modelfleet.dataplane.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend", "register_backend"]
