"""The weight-only int8 matmul (quantization.int8_weight_only_matmul) against dequantize-then-matmul: every
autotune config on its own, the autotuned path at serving batch sizes, and which configs each M bucket
is tuned over.

The kernel cases run on a GPU, or on the CPU under Triton's interpreter: the last test here runs them
that way in a pytest of its own (the interpreter must be on before triton.jit runs; its autotuner needs a
GPU, so the interpreter cases launch each config's kernel directly)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).parent
# bf16 activations against a float32 product of the same dequantized weight: the kernel's sums are fp32,
# so the differences are the bf16 rounding of the output (float32 under the interpreter: exact sums)
TOL = {"cuda": {"atol": 2e-2, "rtol": 1e-2}, "cpu": {"atol": 1e-4, "rtol": 1e-4}}
# The configs tuned for at most 64 rows before large-M tiles were added: decode batches keep these.
SMALL_M_CONFIGS = {
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (16, 32, 256, 4, 4),
    (16, 64, 256, 4, 4),
    (16, 64, 128, 4, 5),
    (16, 128, 128, 4, 4),
    (16, 128, 64, 8, 4),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
}


def int8_kernel():
    pytest.importorskip("triton")
    from modelfleet.dataplane.quantization import _triton_int8_kernel

    return _triton_int8_kernel()


def operands(m, n, k, device):
    from modelfleet.dataplane.quantization import quantize_int8

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k, device=device).to(dtype)
    weight, scale = quantize_int8(torch.randn(n, k) / k**0.5)
    weight[3] = -127  # a full-scale channel: the conversion must keep the code's sign and magnitude
    return x, weight.to(device), scale.to(device)


def reference(x, weight, scale):
    from modelfleet.dataplane.quantization import dequantize

    return F.linear(x.float(), dequantize(weight, scale)).to(x.dtype)


def tile(config) -> tuple:
    kw = config.kwargs
    return (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], config.num_warps, config.num_stages)


def test_m_buckets_separate_decode_batches_from_prefill_without_one_per_batch_size():
    from modelfleet.dataplane.quantization import int8_m_bucket

    assert [int8_m_bucket(m) for m in (1, 16, 17, 64, 65, 128, 129, 256, 300, 512, 513, 8192)] == [
        16, 16, 64, 64, 128, 128, 256, 256, 512, 512, 1024, 1024,
    ]  # fmt: skip
    assert len({int8_m_bucket(m) for m in range(1, 20000)}) == 6


def test_small_buckets_keep_their_configs_and_large_ones_get_hopper_tiles():
    from modelfleet.dataplane.quantization import int8_configs_for

    kernel = int8_kernel()
    assert "M_BUCKET" in kernel.keys and "M" not in kernel.keys  # no tuning per exact batch size
    for bucket in (16, 64):
        picked = int8_configs_for(kernel.configs, {"M_BUCKET": bucket})
        assert {tile(c) for c in picked} == SMALL_M_CONFIGS and len(picked) == len(SMALL_M_CONFIGS)
        assert not any(c.kwargs["WEIGHT_LHS"] for c in picked)
    for bucket in (128, 256, 512, 1024):
        picked = int8_configs_for(kernel.configs, {"M_BUCKET": bucket})
        assert all(c.kwargs["BLOCK_M"] >= 64 or c.kwargs["WEIGHT_LHS"] for c in picked)
        assert not SMALL_M_CONFIGS.isdisjoint(tile(c) for c in picked)  # tuned against the old tiles too
        lhs = [tile(c) for c in picked if c.kwargs["WEIGHT_LHS"]]
        assert (128, 128, 64, 8, 4) in lhs and (128, 256, 64, 8, 3) in lhs
        # with the weight on the left, BLOCK_N is the wgmma's M: 64 rows per warpgroup
        assert all(bn % (64 * (w // 4)) == 0 for _, bn, _, w, _ in lhs)
    assert all(c.kwargs["GROUP_M"] == 8 for c in kernel.configs)


def launch_config(config, x, weight, scale):
    """The kernel with one config's meta-parameters, as the autotuner would launch it."""
    from modelfleet.dataplane.quantization import int8_m_bucket, int8_matmul_grid

    m, k = x.shape
    n = weight.shape[0]
    y = torch.full((m, n), float("nan"), device=x.device, dtype=x.dtype)  # a tile left unwritten shows
    int8_kernel().fn[int8_matmul_grid(m, n)](
        x, weight, scale, y, m, n, k, int8_m_bucket(m), x.stride(0), weight.stride(0), y.stride(0),
        **config.all_kwargs(),
    )  # fmt: skip
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(16))
def test_every_config_matches_the_dequantized_weight(device, index):
    """Each candidate on its own (the autotuner would hide a wrong one until it won): tails in M, N and K,
    and more row tiles than GROUP_M for the 16-row tiles (a last, partial group)."""
    configs = int8_kernel().configs
    assert len(configs) == 16  # a new config needs its case here
    x, weight, scale = operands(300, 320, 200, device)
    got = launch_config(configs[index], x, weight, scale)
    torch.testing.assert_close(got, reference(x, weight, scale), **TOL[device.type])


@pytest.mark.gpu
@pytest.mark.parametrize("weight_lhs", [False, True])
def test_grouped_tile_order_covers_every_tile_once(device, weight_lhs):
    """Small tiles, so that several groups of GROUP_M row tiles (the last one partial) span many columns."""
    import triton

    x, weight, scale = operands(150, 200, 96, device)
    config = triton.Config(
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4, "WEIGHT_LHS": weight_lhs},
        num_warps=4,
        num_stages=2,
    )
    got = launch_config(config, x, weight, scale)
    torch.testing.assert_close(got, reference(x, weight, scale), **TOL[device.type])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 128, 300, 512])
@pytest.mark.parametrize(("n", "k"), [(1024, 4096), (4096, 1024), (1000, 2112)])
def test_autotuned_matmul_matches_the_dequantized_weight(device, m, n, k):
    if device.type != "cuda":
        pytest.skip("the autotuner times candidates on a GPU")
    from modelfleet.dataplane.quantization import int8_weight_only_matmul

    x, weight, scale = operands(m, n, k, device)
    got = int8_weight_only_matmul(x, weight, scale)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference(x, weight, scale), **TOL["cuda"])


def test_int8_matmul_cases_pass_under_the_triton_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already under the interpreter (this test starts it)")
    cases = [
        "test_every_config_matches_the_dequantized_weight",
        "test_grouped_tile_order_covers_every_tile_once",
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--timeout=240"]
    proc = subprocess.run(
        [*cmd, *(f"{Path(__file__)}::{case}" for case in cases)],
        cwd=HERE.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    last = output.splitlines()[-1]
    assert "18 passed" in last and "skipped" not in last, output[-2000:]
