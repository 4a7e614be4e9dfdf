"""Op registry: one implementation of each op per device type, overridable by users.

Layers never call a kernel directly; they ask `get_op(name, device_type)` at run time, so a kernel
registered later (a Triton kernel on "cuda", a user's own on "cpu") is used from the next call on.

    @register_op("rms_norm", "cpu")
    def my_rms_norm(x, weight, eps): ...

Lookup order: (name, device_type), then (name, "*") — the torch reference of layers/, registered with
the other built-ins by `register_builtins()` (modelfleet.dataplane.registration), which loading a model calls.

The ops the models use, and the signatures an implementation must have (T tokens, H heads, D head dim):
    rms_norm(x [T, N], weight [N], eps) -> [T, N]
    fused_add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    rotary_embedding(q [T, Hq, D], k [T, Hkv, D], cos [T, D/2], sin [T, D/2]) -> (q, k)  (halves rotate)
    silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]
    linear(x [T, in], weight [out, in], bias [out] | None) -> [T, out]
Attention has its own interface and registry (modelfleet.dataplane.attention).
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
        raise KeyError(
            f"op {name!r} has no implementation for device {device_type!r}; known ops: {known or 'none'} "
            "(modelfleet.dataplane.registration.register_builtins() registers the built-in ones)"
        )
    return fn


def registered_ops() -> dict[tuple[str, str], Callable[..., Any]]:
    return dict(_REGISTRY)
