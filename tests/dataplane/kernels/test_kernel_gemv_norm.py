"""The GEMV with the RMSNorm of its input computed inside (gemv(..., norm=...)) and with the residual added
in its epilogue (gemv(..., residual=...)), for bf16, int8 and fp8 weights; and the Llama decoder layers
that use both at decode (LlamaDecoderLayer.forward_fused), against the layers with their norm kernels.

The norm is not bit-equal to rms_norm then the GEMV: the fused one keeps the normalized input in float32
where the norm kernel rounds it to bf16 before the GEMV reads it, so both are compared with a float32
reference. The kernel cases and the layers' wiring run on a GPU, or on the CPU under Triton's
interpreter: one test here runs the small ones that way in a pytest of its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dataplane.kernels.test_kernel_gemv_silu import (
    LAUNCHES,
    WEIGHTS,
    decode_step,
    down_weight,
    launch_shape,
    random_llama,
    skip_fp8_where_missing,
)

# LAUNCHES are the fused activation's cases; with a norm or a residual, "split" runs as one split
TOL = {"atol": 3e-2, "rtol": 3e-2}  # bf16 results against a float32 product
EPS = 1e-5


def float_weight(weight, scale):
    from modelfleet.dataplane.quantization import dequantize

    return weight.float() if scale is None else dequantize(weight, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_norm_inside_the_gemv_is_rms_norm_then_the_linear(device, weights, launch):
    from modelfleet.dataplane.kernels.gemv import gemv

    skip_fp8_where_missing(weights, device)
    m, n, k, config = launch_shape(launch)
    x = (3 * torch.randn(m, k)).to(device, torch.bfloat16)
    norm_weight = (torch.rand(k) + 0.5).to(device, torch.bfloat16)
    weight, scale = down_weight(n, k, weights, device)
    bias = torch.randn(n).to(device, torch.bfloat16) if launch == "split" else None
    got = gemv(x, weight, bias, scale=scale, config=config, norm=(norm_weight, EPS))
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.float()
    want = F.linear(normed, float_weight(weight, scale), None if bias is None else bias.float())
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("launch", ["even", "split"])
def test_residual_is_added_in_place(device, weights, silu_mul, launch):
    """The result is residual + the product, written into residual (the stream the next layer reads)."""
    from modelfleet.dataplane.kernels.activation import silu_and_mul
    from modelfleet.dataplane.kernels.gemv import gemv

    skip_fp8_where_missing(weights, device)
    m, n, k, config = launch_shape(launch)
    x = (2 * torch.randn(m, 2 * k if silu_mul else k)).to(device, torch.bfloat16)
    weight, scale = down_weight(n, k, weights, device)
    residual = (4 * torch.randn(m, n)).to(device, torch.bfloat16)
    before = residual.clone()
    got = gemv(x, weight, scale=scale, config=config, silu_mul=silu_mul, residual=residual)
    assert got.data_ptr() == residual.data_ptr()
    product = gemv(x, weight, scale=scale, config=config, silu_mul=silu_mul)
    # the unfused add: the product rounded to bf16 first, then the sum
    torch.testing.assert_close(residual.float(), (before.float() + product.float()), **TOL)
    act = silu_and_mul(x).float() if silu_mul else x.float()
    want = before.float() + F.linear(act, float_weight(weight, scale))
    torch.testing.assert_close(residual.float(), want, **TOL)


def test_bad_norm_and_residual_arguments_are_refused():
    from modelfleet.dataplane.kernels.gemv import gemv

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm and silu_mul"):
        gemv(torch.zeros(2, 128, dtype=torch.bfloat16), weight, silu_mul=True, norm=(torch.ones(64), EPS))
    with pytest.raises(ValueError, match=r"norm's weight must be contiguous \[64\]"):
        gemv(x, weight, norm=(torch.ones(32), EPS))
    with pytest.raises(ValueError, match=r"residual must be torch.bfloat16 \[2, 8\]"):
        gemv(x, weight, residual=torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual must be"):
        gemv(x, weight, residual=torch.zeros(2, 8, dtype=torch.float32))


# ---- the decoder layers at decode ----


def allow_fusion_anywhere(monkeypatch) -> None:
    """The layers' fused path on any device (the CPU under the interpreter too), the GEMV taking every
    projection: what norms_fuse and gemv_operands choose on a GPU for decode rows."""
    from modelfleet.dataplane.layers import Linear
    from modelfleet.dataplane.models import llama
    from modelfleet.dataplane.quantization import QuantizedLinear

    def operands(linear, x):
        if isinstance(linear, QuantizedLinear):
            return linear.weight, linear.bias, linear.weight_scale
        assert isinstance(linear, Linear)
        return linear.weight, linear.bias, None

    monkeypatch.setattr(llama, "gemv_operands", operands)
    monkeypatch.setattr(llama, "norms_fuse", lambda layer, hidden: layer.fuse_norms)


def count_norm_gemvs(monkeypatch) -> list:
    from modelfleet.dataplane.kernels import gemv as gemv_module

    calls: list = []
    real = gemv_module.gemv

    def counting(*args, **kwargs):
        calls.append("norm" if kwargs.get("norm") else "add" if kwargs.get("residual") is not None else "-")
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counting)
    return calls


def small_llama(device, weights):
    """random_llama's model with small shapes (the interpreter is slow), on `device`."""
    from modelfleet.dataplane.attention import get_backend
    from modelfleet.dataplane.models import ModelConfig
    from modelfleet.dataplane.models.llama import LlamaForCausalLM
    from modelfleet.dataplane.quantization import QuantizedLinear, quantize
    from modelfleet.dataplane.registration import register_builtins

    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": EPS,
        "tie_word_embeddings": False, "eos_token_id": 2,
    }  # fmt: skip
    if weights != "bf16":
        hf_config["quantization_config"] = {"quant_method": "modelfleet", "format": weights}
    register_builtins()
    torch.manual_seed(0)
    backend = get_backend("triton" if device.type == "cuda" else "torch")
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_config), backend).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = (torch.randn(p.shape) * 0.1 + (1.0 if p.dim() == 1 else 0.0)).to(device, torch.bfloat16)
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                q, scale = quantize(torch.randn(module.out_features, module.in_features) * 0.1, weights)
                module.weight, module.weight_scale = q.to(device), scale.to(device)
    model.after_load(device)
    return model.requires_grad_(False)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "int8"])  # fp8's fused GEMVs: the kernel cases above
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_layers_give_the_layers_with_norm_kernels(device, monkeypatch, weights, batch):
    """Every layer runs its two norms inside the qkv and gate_up GEMVs and its two residual adds inside the
    o and down GEMVs. The KV written is the norm kernels' path's; the logits are no further from the
    float32 model's than that path's are (they skip its roundings to bf16, see the 1B test below)."""
    from modelfleet.dataplane.models.llama import LlamaDecoderLayer

    if device.type == "cpu":
        allow_fusion_anywhere(monkeypatch)
    model = small_llama(device, weights)
    calls = count_norm_gemvs(monkeypatch)
    fused_kv: list = []
    fused = decode_step(model, batch, device, caches=fused_kv)
    # ("-": the lm_head, a plain GEMV on a GPU)
    assert [c for c in calls if c != "-"] == ["norm", "add", "norm", "add"] * model.config.num_layers
    monkeypatch.setattr(LlamaDecoderLayer, "fuse_norms", False)
    calls.clear()
    plain_kv: list = []
    plain = decode_step(model, batch, device, caches=plain_kv)
    assert "norm" not in calls and "add" not in calls
    for a, b in zip(fused_kv, plain_kv, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **TOL)
    truth = decode_step(small_llama(device, weights).float(), batch, device, kv_dtype=torch.float32)
    fused_error, plain_error = (fused - truth).abs().mean(), (plain - truth).abs().mean()
    assert fused_error <= 1.25 * plain_error, (fused_error.item(), plain_error.item())
    torch.testing.assert_close(fused, truth, atol=0.1, rtol=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_the_1b_shapes_fuse_at_decode_and_not_at_prefill(device, monkeypatch, weights):
    """On a GPU the choice is the model's own: decode rows of the 1B's shapes take the fused layers, more
    rows than a GEMV takes do not. The fused logits are no further from the model's float32 logits than
    those of the norm kernels' path: rounding the normalized input and each partial sum to bf16, as that
    path does, is what they skip (on this random model that path's logits are, in a CPU emulation, about
    twice as far from float64's: mean 0.053 against 0.026)."""
    if device.type != "cuda":
        pytest.skip("the layers fuse their norms on CUDA devices only")
    from modelfleet.dataplane.models.llama import LlamaDecoderLayer

    model = random_llama(device, weights)
    calls = count_norm_gemvs(monkeypatch)
    fused = decode_step(model, 1, device)
    assert calls.count("norm") == calls.count("add") == 2 * model.config.num_layers
    monkeypatch.setattr(LlamaDecoderLayer, "fuse_norms", False)
    plain = decode_step(model, 1, device)
    # float32 is no GEMV dtype: this copy runs the norm kernels and F.linear (dequantized int8) throughout
    truth = decode_step(random_llama(device, weights).float(), 1, device, kv_dtype=torch.float32)
    fused_error, plain_error = (fused - truth).abs().mean(), (plain - truth).abs().mean()
    assert fused_error <= 1.25 * plain_error, (fused_error.item(), plain_error.item())
    calls.clear()
    monkeypatch.setattr(LlamaDecoderLayer, "fuse_norms", True)
    decode_step(model, 8, device)  # more rows than any GEMV takes
    assert "norm" not in calls and "add" not in calls


def test_the_layers_keep_their_norm_kernels_off_the_gpu():
    from modelfleet.dataplane.models.llama import norms_fuse

    model = small_llama(torch.device("cpu"), "bf16")
    assert not norms_fuse(model.model.layers[0], torch.zeros(1, 64, dtype=torch.bfloat16))


INTERPRETER_CASES = [
    # ragged K, masked rows and per-tile sums, for packed int8 words and plain bf16
    "test_norm_inside_the_gemv_is_rms_norm_then_the_linear[ragged-int8]",
    "test_norm_inside_the_gemv_is_rms_norm_then_the_linear[ragged-bf16]",
    "test_residual_is_added_in_place[even-True-int8]",
    "test_residual_is_added_in_place[split-False-bf16]",
    # one layer case, for the wiring (two rows, the SiLU-and-mul GEMV adding): bf16, ~12 s there where
    # int8's takes ~34 s (its packed words are the kernel cases' above)
    "test_fused_layers_give_the_layers_with_norm_kernels[2-bf16]",
]
