"""bench/gemv.py --as-model times each projection's GEMV with the keywords it names (AS_MODEL): those must
be the ones the decode layer's forward_fused passes, or the bench tunes launches the model never makes.
The layer runs on the CPU with the GEMV recorded (and computed by torch), the attention left out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 64, 128, 4, 2


def small_layer():
    from modelfleet.dataplane.attention import get_backend
    from modelfleet.dataplane.models import ModelConfig
    from modelfleet.dataplane.models.llama import LlamaDecoderLayer
    from modelfleet.dataplane.registration import register_builtins

    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 100,
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": 1,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256,
        }
    )
    register_builtins()  # as an engine's start: the torch attention backend among them
    return LlamaDecoderLayer(config, 0, get_backend("torch"))


def recording_gemv(calls: list):
    """A stand-in for the GEMV kernel that records each call's fusion keywords and computes its result."""

    def gemv(x, weight, bias=None, *, scale=None, config=None, silu_mul=False, norm=None, residual=None):
        calls.append({"norm": norm is not None, "residual": residual is not None, "silu_mul": silu_mul})
        if silu_mul:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        if norm is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0]
        out = F.linear(x, weight, bias)
        return out if residual is None else residual.add_(out)

    return gemv


def test_as_model_names_the_keywords_forward_fused_passes(bench_scripts, monkeypatch):
    import gemv as bench_gemv
    from modelfleet.dataplane.kernels import gemv as gemv_module
    from modelfleet.dataplane.kernels import registry
    from modelfleet.dataplane.models import llama

    calls: list = []
    monkeypatch.setattr(gemv_module, "gemv", recording_gemv(calls))
    # as on a GPU: the Triton silu_and_mul is the registered op, so the down GEMV takes the activation
    monkeypatch.setattr(llama, "get_op", lambda name, device_type: getattr(registry, name))
    layer = small_layer()
    q_width = HIDDEN // HEADS * HEADS
    monkeypatch.setattr(layer.self_attn, "attend", lambda qkv, *args: torch.zeros(qkv.shape[0], q_width))
    with torch.no_grad():
        layer.forward_fused(torch.randn(2, HIDDEN), None, None, None, None, None)

    projections = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # forward_fused's order
    assert len(calls) == len(projections)
    for proj, call in zip(projections, calls, strict=True):
        named = bench_gemv.AS_MODEL[proj]
        want = {key: bool(named.get(key)) for key in ("norm", "residual", "silu_mul")}
        assert call == want, proj
    assert bench_gemv.AS_MODEL["lm_head"] == {}  # the head is a plain GEMV
    assert set(bench_gemv.AS_MODEL) == {proj for _, proj, _, _ in bench_gemv.SHAPES}


@pytest.mark.parametrize("proj", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"])
def test_as_called_builds_the_inputs_of_that_call(bench_scripts, proj):
    """The x and keywords the bench hands the GEMV: [m, 2K] for SiLU-and-mul, a [K] norm weight, an [m, N]
    residual; plain calls get x [m, K] and nothing else."""
    import gemv as bench_gemv

    seen = {}

    def kernel(x, w, **fusion):
        seen.update(fusion)
        return x

    n, k, m = 24, 40, 3
    call, x = bench_gemv.as_called(kernel, proj, n, k, m, torch.float32, "cpu", True)
    call(x, None)
    named = bench_gemv.AS_MODEL[proj]
    assert x.shape == (m, 2 * k if named.get("silu_mul") else k)
    assert ("norm" in seen) == bool(named.get("norm"))
    if "norm" in seen:
        assert seen["norm"][0].shape == (k,)
    assert ("residual" in seen) == bool(named.get("residual"))
    if "residual" in seen:
        assert seen["residual"].shape == (m, n)
    plain_call, plain_x = bench_gemv.as_called(kernel, proj, n, k, m, torch.float32, "cpu", False)
    seen.clear()
    plain_call(plain_x, None)
    assert plain_x.shape == (m, k) and seen == {}
