"""Op registry: one implementation of each op per device type, overridable by users.

Layers never call a kernel directly; they ask `get_op(name, device_type)` at run time, so a kernel
registered later (a Triton kernel on "cuda", a user's own on "cpu") is used from the next call on.

    @register_op("rms_norm", "cpu")
    def my_rms_norm(x, weight, eps): ...

Lookup order: (name, device_type), then (name, "*") — the torch reference, registered by layers/.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

ANY_DEVICE = "*"
OpFn = TypeVar("OpFn", bound=Callable[..., Any])

_REGISTRY: dict[tuple[str, str], Callable[..., Any]] = {}


def register_op(name: str, device_type: str = ANY_DEVICE) -> Callable[[OpFn], OpFn]:
    """Decorator: make `fn` the implementation of op `name` on `device_type` ("cpu", "cuda", ... or "*")."""

    def decorator(fn: OpFn) -> OpFn:
        _REGISTRY[(name, device_type)] = fn
        return fn

    return decorator


def unregister_op(name: str, device_type: str) -> None:
    """Remove an implementation (e.g. a user override), falling back to the reference again."""
    _REGISTRY.pop((name, device_type), None)


def get_op(name: str, device_type: str) -> Callable[..., Any]:
    fn = _REGISTRY.get((name, device_type)) or _REGISTRY.get((name, ANY_DEVICE))
    if fn is None:
        known = ", ".join(sorted({n for n, _ in _REGISTRY}))
        raise KeyError(f"op {name!r} has no implementation for device {device_type!r}; known ops: {known}")
    return fn


def registered_ops() -> dict[tuple[str, str], Callable[..., Any]]:
    return dict(_REGISTRY)
