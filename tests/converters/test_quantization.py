"""Per-channel int8 / fp8 weight quantization and QuantizedLinear, against a float reference."""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane.quantization import (
    FP8_DTYPE,
    QuantizationError,
    QuantizedLinear,
    check_fp8_supported,
    dequantize,
    fp8_supported,
    quantize,
    quantize_fp8,
    quantize_int8,
)
from torch import nn

CUDA_FP8 = torch.cuda.is_available() and fp8_supported("cuda")


def weight(out: int = 96, inp: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    w[3] *= 50  # one loud channel: per-channel scales must keep the others precise
    w[5] = 0  # an all-zero channel must not divide by zero
    return w


def test_int8_is_symmetric_per_channel_and_close():
    w = weight()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert q.abs().amax(dim=1)[[0, 3]].tolist() == [127, 127]  # each row spans the full range
    assert torch.all(q[5] == 0)
    err = (dequantize(q, scale) - w).abs()
    # Round-to-nearest: at most half a step of each row's own scale.
    assert torch.all(err <= scale[:, None] / 2 + 1e-9)


def test_fp8_is_per_channel_and_close():
    w = weight()
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (w.shape[0],)
    assert q.float().abs().amax(dim=1)[0].item() == 448.0
    rel = (dequantize(q, scale) - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    assert rel.max() < 2**-4  # e4m3 keeps 3 mantissa bits
    assert torch.isfinite(dequantize(q, scale)).all()


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="quantization format 'int4' is unknown; use one of: int8, fp8"):
        quantize(weight(), "int4")
    with pytest.raises(ValueError, match="must be 2-D"):
        quantize_int8(torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_dequantized_reference_on_cpu(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    qlinear = QuantizedLinear.from_float(linear, "int8")
    x = torch.randn(2, 5, 64).to(dtype)
    reference = nn.functional.linear(
        x.float(), dequantize(qlinear.weight, qlinear.weight_scale), linear.bias if bias else None
    )
    y = qlinear(x)
    assert y.shape == (2, 5, 96) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), reference, atol=tol, rtol=tol)
    # And close to the unquantized layer: int8 error is small next to the outputs' spread.
    assert (y.float() - linear(x.float())).abs().max() < 0.05 * linear(x.float()).abs().max()


def test_int8_linear_loads_a_state_dict_with_its_dtypes():
    source = QuantizedLinear.from_float(nn.Linear(32, 16, bias=False), "int8")
    target = QuantizedLinear(32, 16, bias=False, fmt="int8")
    target.load_state_dict(source.state_dict(), assign=True)
    assert target.weight.dtype == torch.int8 and target.weight_scale.dtype == torch.float32
    x = torch.randn(3, 32)
    torch.testing.assert_close(target(x), source(x))


@pytest.mark.skipif(CUDA_FP8, reason="this host runs fp8; the refusal is for hosts without it")
def test_fp8_refuses_clearly_without_a_capable_gpu():
    qlinear = QuantizedLinear.from_float(nn.Linear(64, 32, bias=False), "fp8")
    with pytest.raises(
        QuantizationError, match=r"fp8 weights need a CUDA GPU with compute capability >= 8\.9"
    ):
        qlinear(torch.randn(2, 64))
    with pytest.raises(QuantizationError, match="serve the int8 or bf16 artifact instead"):
        check_fp8_supported("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 33, 300])
@pytest.mark.parametrize(("inp", "out"), [(256, 512), (96, 200)])
def test_int8_linear_on_cuda(rows, inp, out):
    torch.manual_seed(0)
    linear = nn.Linear(inp, out, bias=True).cuda().to(torch.bfloat16)
    qlinear = QuantizedLinear.from_float(linear, "int8").cuda()
    x = torch.randn(rows, inp, device="cuda", dtype=torch.bfloat16)
    ref = nn.functional.linear(
        x.float(), dequantize(qlinear.weight, qlinear.weight_scale), linear.bias.float()
    )
    torch.testing.assert_close(qlinear(x).float(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with compute capability >= 8.9 (L4, H100, H200)")
@pytest.mark.parametrize("rows", [1, 16, 33])
def test_fp8_linear_on_cuda(rows):
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=False).cuda()
    qlinear = QuantizedLinear.from_float(linear, "fp8").cuda()
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    y = qlinear(x)
    ref = linear(x.float())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 512)
    # Both weights and activations are e4m3: a few percent of the output's range.
    assert (y.float() - ref).abs().max() < 0.08 * ref.abs().max()


def test_int8_linear_runs_an_unaligned_weight():
    """mmap-loaded safetensors hand out weights at any byte offset; the int8 kernel must still run."""
    q, scale = quantize_int8(weight(64, 64))
    buffer = torch.empty(64 * 64 + 40, dtype=torch.int8)
    unaligned = buffer[40:].view(64, 64)
    unaligned.copy_(q)
    qlinear = QuantizedLinear(64, 64, bias=False, fmt="int8")
    qlinear.weight, qlinear.weight_scale = unaligned, scale
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    reference = x.float() @ dequantize(q, scale).t()
    torch.testing.assert_close(qlinear(x).float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1, 64), (7, 4096), (3, 1000)])
def test_fp8_row_quantization_on_cuda_matches_the_torch_reference(shape):
    from modelfleet.dataplane.quantization import FP8_MAX, quantize_rows_fp8

    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = quantize_rows_fp8(x)
    ref_scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    torch.testing.assert_close(scale, ref_scale)
    ref_q = (x.float() / ref_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    torch.testing.assert_close(q.float(), ref_q.float(), atol=0, rtol=2**-3)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_benchmarks_quantized_artifact_is_the_converters(tmp_path, monkeypatch, fmt):
    """bench/latency.py and bench/throughput.py --quantize build their artifact on the GPU themselves
    (the converter's CPU pass takes minutes on 8B weights): it must hold what `modelfleet convert` writes."""
    import json
    import sys
    from pathlib import Path

    from modelfleet.converters.checkpoint import read_checkpoint, write_torch
    from modelfleet.dataplane.demo.model import create_demo_model
    from safetensors.torch import load_file

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    sys.modules.pop("throughput", None)
    from throughput import quantized_artifact

    source = create_demo_model(tmp_path / "src")
    (tmp_path / "conv").mkdir()
    write_torch(read_checkpoint(source), tmp_path / "conv", dtype="bf16", quant=fmt, serving_dtype="bf16")
    bench = Path(quantized_artifact(source, fmt, tmp_path / "bench"))
    converted = load_file(tmp_path / "conv" / "model.safetensors")
    got = load_file(bench / "model.safetensors")
    quantized = [name for name in converted if name.endswith("_scale")]
    assert quantized and sorted(got) == sorted(converted)
    for name in quantized:
        weight_name = name.removesuffix("_scale")
        assert (
            got[weight_name].dtype
            == converted[weight_name].dtype
            == (FP8_DTYPE if fmt == "fp8" else torch.int8)
        )
        assert torch.equal(got[weight_name].view(torch.int8), converted[weight_name].view(torch.int8))
        torch.testing.assert_close(got[name], converted[name], rtol=0, atol=0)
    config = json.loads((bench / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "modelfleet",
        "format": fmt,
        "group": "per-channel",
    }
    assert (bench / "tokenizer.json").is_file()
    assert quantized_artifact(source, fmt, bench) == str(bench)  # a finished artifact is reused
