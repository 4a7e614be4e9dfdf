"""Attention backends behind one interface; `get_backend(name)` returns one. The built-in ones ("torch",
and "triton" where Triton is installed) are registered by modelfleet.dataplane.registration's
`register_builtins`, which loading a model calls; importing this package registers nothing."""

from modelfleet.dataplane.attention.backend import (
    AttentionBackend,
    available_backends,
    get_backend,
    register_backend,
)
from modelfleet.dataplane.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend", "register_backend"]
