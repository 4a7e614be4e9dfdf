"""Demo model: a random-weight Llama checkpoint and a tokenizer trained offline, for tests and benchmarks.

The names below are imported on first use, so the `modelfleet demo` parser does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SIZES": "modelfleet.dataplane.demo.model",
    "create_demo_model": "modelfleet.dataplane.demo.model",
    "train_tokenizer": "modelfleet.dataplane.demo.tokenizer",
}

__all__ = ["SIZES", "create_demo_model", "train_tokenizer"]

if TYPE_CHECKING:
    from modelfleet.dataplane.demo.model import SIZES, create_demo_model
    from modelfleet.dataplane.demo.tokenizer import train_tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'modelfleet.dataplane.demo' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
