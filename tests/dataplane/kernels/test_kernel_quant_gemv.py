"""The GEMV reading 1-byte weights (int8, float8 e4m3) with per-channel scales, against the dequantized
weight in float32; and QuantizedLinear's choice of it for decode-sized inputs.

The kernel cases run on a GPU, or on the CPU under Triton's interpreter: the last test here runs a few
small ones that way in a pytest of its own (the interpreter must be on before triton.jit runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

FORMATS = ["int8", "fp8"]
# bf16 activations against a float32 product of the same (dequantized) weight: the kernel's sums are fp32,
# so the differences are the bf16 rounding of x's products and of the output
TOL = {"atol": 3e-2, "rtol": 3e-2}


def quantized_linear(m, n, k, fmt, device, with_bias, dtype=torch.bfloat16):
    from modelfleet.dataplane.quantization import quantize

    x = torch.randn(m, k, device=device).to(dtype)
    weight, scale = quantize(torch.randn(n, k) / k**0.5, fmt)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    return x, weight.to(device), scale.to(device), bias


def reference(x, weight, scale, bias):
    from modelfleet.dataplane.quantization import dequantize

    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(weight.cpu(), scale.cpu()).to(x.device), b).to(x.dtype)


def skip_fp8_where_missing(fmt, device):
    if fmt == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("float8 e4m3 loads need compute capability 8.9 or newer")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("n", "k"),
    # 1B qkv, gate_up and down (tuned tiles, doubled for 1-byte weights or not), 8B down (long K), odd sizes
    [(3072, 2048), (16384, 2048), (2048, 8192), (4096, 14336), (17, 1000)],
)
def test_quantized_gemv_matches_the_dequantized_weight(device, fmt, m, n, k):
    from modelfleet.dataplane.kernels.gemv import gemv

    skip_fp8_where_missing(fmt, device)
    x, weight, scale, bias = quantized_linear(m, n, k, fmt, device, with_bias=n == 17)
    got = gemv(x, weight, bias, scale=scale)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference(x, weight, scale, bias), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("reduce_at_end", [False, True])
def test_quantized_gemv_every_launch_shape(device, fmt, split_k, reduce_at_end):
    """Ragged K, a ragged last row block, K split (scales applied after the partial sums are added),
    more rows of x than one program takes, and a bias."""
    from modelfleet.dataplane.kernels.gemv import GemvConfig, gemv

    skip_fp8_where_missing(fmt, device)
    x, weight, scale, bias = quantized_linear(6, 37, 1000, fmt, device, with_bias=True)
    config = GemvConfig(block_n=8, block_k=128, num_warps=4, split_k=split_k, reduce_at_end=reduce_at_end)
    got = gemv(x, weight, bias, scale=scale, config=config)
    torch.testing.assert_close(got, reference(x, weight, scale, bias), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_weight_code_decodes_exactly_at_every_byte_position(device, fmt):
    """The bit-operation decode of 4-byte words: every int8 value and every finite e4m3 value (subnormals
    and negative zero included) sits once in each of a word's 4 byte places; x of ones reads it back
    exactly (each code is a bf16 value), against the decode by conversion instructions."""
    from modelfleet.dataplane.kernels.gemv import GemvConfig, gemv

    skip_fp8_where_missing(fmt, device)
    if fmt == "int8":
        codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    else:
        codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
        codes = codes[~codes.float().isnan()]
    n, k = 4 * len(codes), 64
    weight = torch.zeros(n, k, dtype=codes.dtype)
    rows = torch.arange(n)
    weight.view(torch.uint8)[rows, rows % 4 + 4 * (rows % 16 // 4)] = codes.repeat_interleave(4).view(
        torch.uint8
    )
    weight, scale = weight.to(device), torch.ones(n, device=device)
    x = torch.ones(1, k, device=device, dtype=torch.bfloat16)
    want = codes.float().repeat_interleave(4).to(device)
    for decode_bits in (True, False):
        # 16 rows a program: the same words decoded, a quarter of the programs under the interpreter
        config = GemvConfig(block_n=16, block_k=64, num_warps=4, decode_bits=decode_bits)
        got = gemv(x, weight, scale=scale, config=config)
        torch.testing.assert_close(got[0].float(), want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_k_that_is_not_whole_words_takes_the_conversion_path(device, fmt):
    from modelfleet.dataplane.kernels.gemv import gemv

    skip_fp8_where_missing(fmt, device)
    x, weight, scale, bias = quantized_linear(2, 33, 1001, fmt, device, with_bias=True)
    torch.testing.assert_close(gemv(x, weight, bias, scale=scale), reference(x, weight, scale, bias), **TOL)


@pytest.mark.gpu
def test_a_corrupted_scale_shows_in_its_channel_only(device):
    """The scale is really read per output channel: doubling one channel's scale doubles that output."""
    from modelfleet.dataplane.kernels.gemv import gemv

    x, weight, scale, _ = quantized_linear(1, 64, 256, "int8", device, with_bias=False)
    good = gemv(x, weight, scale=scale).float()
    bad_scale = scale.clone()
    bad_scale[5] *= 2
    bad = gemv(x, weight, scale=bad_scale).float()
    torch.testing.assert_close(bad[:, 5], 2 * good[:, 5], rtol=1e-2, atol=1e-3)
    keep = torch.arange(64, device=device) != 5
    torch.testing.assert_close(bad[:, keep], good[:, keep], rtol=0, atol=0)


def test_quantized_gemv_refuses_a_missing_or_misplaced_scale():
    from modelfleet.dataplane.kernels.gemv import gemv

    x = torch.randn(1, 64, dtype=torch.bfloat16)
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs its per-channel scale"):
        gemv(x, q)
    with pytest.raises(ValueError, match="scale goes with an int8"):
        gemv(x, torch.zeros(8, 64, dtype=torch.bfloat16), scale=torch.ones(8))
    with pytest.raises(ValueError, match="contiguous float32"):
        gemv(x, q, scale=torch.ones(8, dtype=torch.bfloat16))


def test_one_byte_weights_take_their_own_table_at_one_row():
    from modelfleet.dataplane.kernels.gemv import TUNED, TUNED_ONE_BYTE, default_config

    assert default_config(1, 2048, 8192, weight_bytes=1) == TUNED_ONE_BYTE[(2048, 8192, 1)]
    assert default_config(1, 2048, 8192) == TUNED[(2048, 8192, 1)] != TUNED_ONE_BYTE[(2048, 8192, 1)]
    assert default_config(2, 2048, 8192, weight_bytes=1) == TUNED[(2048, 8192, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 4, 5])
def test_quantized_linear_uses_the_gemv_for_decode_only(device, monkeypatch, fmt, m):
    if device.type != "cuda":
        pytest.skip("QuantizedLinear takes the GEMV on CUDA devices")
    skip_fp8_where_missing(fmt, device)
    from modelfleet.dataplane import quantization
    from modelfleet.dataplane.kernels import gemv as gemv_module

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    linear = torch.nn.Linear(2048, 3072, bias=True).to(device)
    module = quantization.QuantizedLinear.from_float(linear, fmt).to(device)
    x = torch.randn(m, 2048, device=device, dtype=torch.bfloat16)
    got = module(x)
    assert bool(calls) == (m <= quantization.GEMV_MAX_TOKENS)
    want = reference(x, module.weight, module.weight_scale, module.bias.detach().to(torch.bfloat16))
    # the prefill fp8 path quantizes activations to e4m3 as well, hence its wider tolerance
    tol = TOL if fmt == "int8" or m <= quantization.GEMV_MAX_TOKENS else {"atol": 0.15, "rtol": 0.1}
    torch.testing.assert_close(got, want, **tol)


INTERPRETER_CASES = [
    "test_quantized_gemv_matches_the_dequantized_weight[17-1000-1-int8]",
    "test_quantized_gemv_matches_the_dequantized_weight[17-1000-3-fp8]",
    "test_quantized_gemv_every_launch_shape[False-3-int8]",
    "test_quantized_gemv_every_launch_shape[True-1-fp8]",
    "test_a_corrupted_scale_shows_in_its_channel_only",
    "test_every_weight_code_decodes_exactly_at_every_byte_position[int8]",
    "test_every_weight_code_decodes_exactly_at_every_byte_position[fp8]",
    "test_a_k_that_is_not_whole_words_takes_the_conversion_path[int8]",
]
