"""The weight-only int8 matmul (quantization.int8_weight_only_matmul) against dequantize-then-matmul: every
autotune config on its own, the autotuned path at serving batch sizes, and which configs each M bucket
is tuned over.

Configs are also compiled for an H100 (sm_90) without one: each must compile, and the IR shows where
the converted weight tile goes.
The kernel cases run on a GPU, or on the CPU under Triton's interpreter: the last test here runs them
that way in a pytest of its own (the interpreter must be on before triton.jit runs; its autotuner needs a
GPU, so the interpreter cases launch each config's kernel directly)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

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


def compile_for_hopper(config):
    """The kernel compiled for an H100 (sm_90) with one config; compiling needs no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": "*bf16"}
    ints = ("M", "N", "K", "M_BUCKET", "stride_xm", "stride_wn", "stride_ym")
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(config.kwargs, "constexpr")}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 8, 9, 10)}  # all but M, M_BUCKET
    source = ASTSource(int8_kernel().fn, signature=signature, constexprs=dict(config.kwargs), attrs=aligned)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def hopper_ttgir(weight_lhs: bool) -> str:
    """The TritonGPU IR at 128x128x64 tiles, the weight on the left or on the right."""
    (config,) = [
        c
        for c in int8_kernel().configs
        if tile(c)[:3] == (128, 128, 64) and c.kwargs["WEIGHT_LHS"] == weight_lhs
    ]
    return compile_for_hopper(config).asm["ttgir"]


def test_every_config_compiles_for_an_h100_within_its_shared_memory():
    """The autotuner skips a config that runs out of resources, but any other compile error would stop
    the first matmul of its M bucket: every candidate compiles for sm_90 and fits an H100's 227 KiB."""
    for config in int8_kernel().configs:
        compiled = compile_for_hopper(config)
        assert 0 < compiled.metadata.shared <= 227 * 1024, (config, compiled.metadata.shared)


def test_the_weight_on_the_left_reaches_wgmma_from_registers():
    """Why the large-M configs put the weight on the left: there the converted int8 tile is wgmma's
    register operand (its bytes copied asynchronously into shared memory first); on the right, each K
    step writes the converted tile back to shared memory for the MMA to read."""
    register_a = re.compile(r"ttng\.warp_group_dot .*: tensor<128x\d+xbf16, #ttg\.dot_op<\{opIdx = 0")
    stored_from_registers = re.compile(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+xbf16")
    left, right = hopper_ttgir(weight_lhs=True), hopper_ttgir(weight_lhs=False)
    assert register_a.search(left) and not stored_from_registers.search(left)
    assert "async_copy_global_to_local" in left  # the int8 bytes are pipelined
    assert stored_from_registers.search(right) and not register_a.search(right)


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


# every config and both tile orders: 18 cases under the interpreter (test_triton_interpreter.py)
INTERPRETER_CASES = [
    "test_every_config_matches_the_dequantized_weight",
    "test_grouped_tile_order_covers_every_tile_once",
]
INTERPRETER_PASSED = 18
