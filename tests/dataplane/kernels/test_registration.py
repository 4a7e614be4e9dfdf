"""Built-in ops, attention backends and kernels are registered by one call at engine start, never by an
import; on a machine without a GPU nothing of Triton is imported."""

from __future__ import annotations

import subprocess
import sys

# Run in a fresh interpreter: this test process has long since loaded models (and registered).
IMPORTS = """
import sys
import modelfleet.dataplane, modelfleet.dataplane.layers, modelfleet.dataplane.models
import modelfleet.dataplane.attention, modelfleet.dataplane.attention.torch_paged
import modelfleet.dataplane.attention.triton_paged, modelfleet.dataplane.kernels.registry
import modelfleet.dataplane.engine.llm_engine, modelfleet.dataplane.engine.model_runner
from modelfleet.dataplane.attention import AttentionBackend, available_backends, get_backend, register_backend
from modelfleet.dataplane.ops import get_op, register_op, registered_ops

assert available_backends() == (), available_backends()
assert registered_ops() == {}, sorted(registered_ops())
"""

EXPLICIT_CALL = (
    IMPORTS
    + """
import importlib.util
from modelfleet.dataplane.layers.norm import rms_norm_native
from modelfleet.dataplane.layers.linear import linear_native
from modelfleet.dataplane.registration import register_builtins

class Mine(AttentionBackend):
    write_kv = forward = None

def my_linear(x, weight, bias):
    return x

register_backend("torch")(Mine)  # a user's own, under a built-in name: kept
register_op("linear")(my_linear)  # likewise for an op
register_builtins()
first = registered_ops()
register_builtins()  # once or twice: the same
assert registered_ops() == first
assert type(get_backend("torch")) is Mine
assert get_op("linear", "cpu") is my_linear
assert get_op("rms_norm", "cpu") is rms_norm_native
assert {name for name, device in first if device == "*"} == {
    "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "linear"
}
assert ("triton" in available_backends()) == (importlib.util.find_spec("triton") is not None)
import torch
if not torch.cuda.is_available():
    assert "triton" not in sys.modules
    assert not [key for key in registered_ops() if key[1] == "cuda"]
print("ok")
"""
)

ENGINE_START = (
    IMPORTS
    + """
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.layers.norm import rms_norm_native

llm = LLM(sys.argv[1], max_model_len=64, kv_cache_bytes=1 << 20, dtype="float32", device="cpu")
assert get_op("rms_norm", "cpu") is rms_norm_native
assert type(get_backend("torch")).__name__ == "TorchPagedAttention"
out = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))[0]
assert len(out.token_ids) == 4, out.token_ids
print("ok")
"""
)


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=180)


def test_imports_register_nothing_and_register_builtins_does():
    done = run(EXPLICIT_CALL)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_engine_registers_the_builtins_at_start_and_runs_on_the_cpu(tiny_model_dir):
    done = run(ENGINE_START, str(tiny_model_dir))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
