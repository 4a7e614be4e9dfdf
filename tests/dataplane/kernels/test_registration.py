"""Built-in attention backends and kernels are registered by one call at engine start, never by an
import; on a machine without a GPU nothing of Triton is imported."""

from __future__ import annotations

import subprocess
import sys

# Run in a fresh interpreter: this test process has long since loaded models (and registered).
SCRIPT = """
import sys
import modelfleet.dataplane.attention, modelfleet.dataplane.attention.torch_paged
import modelfleet.dataplane.attention.triton_paged, modelfleet.dataplane.kernels.registry
import modelfleet.dataplane.models, modelfleet.dataplane.engine.model_runner
from modelfleet.dataplane.attention import AttentionBackend, available_backends, get_backend, register_backend
from modelfleet.dataplane.ops import registered_ops
from modelfleet.dataplane.registration import register_builtins

assert available_backends() == (), available_backends()
assert not [key for key in registered_ops() if key[1] == "cuda"]

class Mine(AttentionBackend):
    write_kv = forward = None

register_backend("torch")(Mine)  # a user's own, under a built-in name: kept
register_builtins()
register_builtins()  # once or twice: the same
assert type(get_backend("torch")) is Mine
import importlib.util
assert ("triton" in available_backends()) == (importlib.util.find_spec("triton") is not None)
import torch
if not torch.cuda.is_available():
    assert "triton" not in sys.modules
    assert not [key for key in registered_ops() if key[1] == "cuda"]
print("ok")
"""


def test_imports_register_nothing_and_register_builtins_does():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
