"""The fp8 (e4m3) KV cache in the Triton kernels: the writes store what kv_quant.quantize stores (the same
bytes), and both attention kernels match the float32 reference over the dequantized cache. The write
cases need a GPU: Triton's interpreter rounds float32 -> e4m3 wrongly (see test_triton_interpreter.py)."""

import pytest
import torch
from modelfleet.dataplane.attention.kv_quant import FP8_KV_DTYPE, FP8_MAX, dequantize, quantize

from tests.dataplane.kernels.paged_batches import TOLERANCES, random_paged_batch
from tests.dataplane.kernels.reference import paged_attention_native
from tests.dataplane.kernels.test_kernel_rotary_kv_write import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    fused_qkv,
    random_cos_sin,
    random_slots,
)

pytestmark = pytest.mark.gpu

# (k_scale, v_scale): the default, and scales small enough that the largest values saturate at +-448
SCALES = [(1.0, 1.0), (0.004, 0.0075)]


def random_fp8_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device):
    """Random e4m3 bytes (NaN codes avoided), so a slot the kernel skips keeps visible garbage."""
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 50
    return values.to(FP8_KV_DTYPE).to(device)


def quantized_copy(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.stack([quantize(cache[0], k_scale), quantize(cache[1], v_scale)])


def dequantized(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.stack(
        [dequantize(cache[0], k_scale, torch.float32), dequantize(cache[1], v_scale, torch.float32)]
    )


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    same = got.view(torch.uint8) == want.view(torch.uint8)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} bytes differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(8, 128), (3, 80)])
def test_write_kv_stores_the_quantized_values(device, dtype, k_scale, v_scale, num_kv_heads, head_dim):
    from modelfleet.dataplane.kernels.kv_write import write_kv

    num_tokens = 37
    cache = random_fp8_cache(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, device)
    want = cache.clone()
    slots = random_slots(num_tokens, device)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=device).mul_(2).to(dtype)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]

    write_kv(k, v, cache, slots, k_scale=k_scale, v_scale=v_scale)

    keep = slots >= 0
    flat = want.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)
    flat[0, slots[keep]] = quantize(k[keep], k_scale).view(torch.uint8)
    flat[1, slots[keep]] = quantize(v[keep], v_scale).view(torch.uint8)
    assert_same_bytes(cache, want)
    if k_scale != 1.0:  # the scale saturates the largest values (and only those) at e4m3's maximum
        written = cache[0].view(-1, num_kv_heads, head_dim)[slots[keep]].float()
        assert bool((written.abs() == FP8_MAX).any())
        # 432 lies halfway between e4m3's two largest values (416, 448): from there on the store gives 448
        scaled = k[keep].float().abs() * (1.0 / k_scale)
        assert bool(((scaled >= 432) == (written.abs() == FP8_MAX)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (14, 2, 64)])
def test_rotary_and_write_kv_matches_the_two_kernels(
    device, dtype, k_scale, v_scale, num_heads, num_kv_heads, head_dim
):
    from modelfleet.dataplane.kernels.kv_write import write_kv
    from modelfleet.dataplane.kernels.rotary import rotary_embedding
    from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv

    num_tokens = 7
    _, q, k, v = fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device)
    cos, sin = random_cos_sin(num_tokens, head_dim, dtype, device)
    slots = random_slots(num_tokens, device)
    cache = random_fp8_cache(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, device)
    two_step = cache.clone()

    got_q, got_k = rotary_and_write_kv(q, k, v, cos, sin, cache, slots, k_scale=k_scale, v_scale=v_scale)

    two_q, two_k = rotary_embedding(q, k, cos, sin)
    write_kv(two_k, v, two_step, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(got_q, two_q) and torch.equal(got_k, two_k)  # unquantized: the model's k
    assert_same_bytes(cache, two_step)


def fp8_batch(seq_lens, query_lens, dtype, device, k_scale, v_scale, *, num_heads, num_kv_heads, head_dim):
    """A random paged batch whose cache is quantized to e4m3 with the given scales (K/V of magnitude
    ~ 1 / scale, so the scale matters), and the float32 cache it stands for."""
    batch = random_paged_batch(
        seq_lens,
        query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    magnitude = torch.tensor([k_scale, v_scale], device=device).view(2, 1, 1, 1, 1)
    batch.kv_cache = quantized_copy(batch.kv_cache * magnitude * 100, k_scale, v_scale)
    batch.q = batch.q.to(dtype)
    return batch, dequantized(batch.kv_cache, k_scale, v_scale)


def reference(batch, float_cache, scale, dtype):
    return paged_attention_native(
        batch.q.float(), float_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    ).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (12, 2, 64)])
def test_decode_reads_the_dequantized_cache(
    device, dtype, k_scale, v_scale, num_splits, num_heads, num_kv_heads, head_dim
):
    from modelfleet.dataplane.kernels.decode_attention import decode_attention

    seq_lens = [1, 17, 150, 40]
    batch, float_cache = fp8_batch(
        seq_lens, [1] * 4, dtype, device, k_scale, v_scale,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
    )  # fmt: skip
    scale = head_dim**-0.5 / (100 * k_scale)  # scores of order 1 for K of magnitude ~100 x k_scale
    got = decode_attention(
        batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
        num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    want = reference(batch, float_cache, scale, dtype)
    torch.testing.assert_close(got, want, **_tolerance(dtype, v_scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (12, 2, 64)])
def test_extend_reads_the_dequantized_cache(
    device, dtype, k_scale, v_scale, num_heads, num_kv_heads, head_dim
):
    from modelfleet.dataplane.kernels.extend_attention import extend_attention

    seq_lens, query_lens = [77, 200, 5, 33], [77, 40, 1, 33]  # prefill, cached prefix, a decode
    batch, float_cache = fp8_batch(
        seq_lens, query_lens, dtype, device, k_scale, v_scale,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
    )  # fmt: skip
    scale = head_dim**-0.5 / (100 * k_scale)
    got = extend_attention(
        batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
        batch.max_query_len, scale, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    want = reference(batch, float_cache, scale, dtype)
    torch.testing.assert_close(got, want, **_tolerance(dtype, v_scale))


def _tolerance(dtype: torch.dtype, v_scale: float) -> dict[str, float]:
    """The kernel dtype's tolerance, relative to the outputs' magnitude (V ~ 100 x v_scale)."""
    tol = TOLERANCES[dtype]
    return {"atol": tol["atol"] * 100 * v_scale, "rtol": tol["rtol"]}


def test_bad_scales_are_refused(device):
    from modelfleet.dataplane.kernels.kv_write import write_kv

    cache = random_fp8_cache(2, 16, 1, 64, device)
    k = torch.randn(1, 1, 64, device=device)
    with pytest.raises(ValueError, match=r"^k_scale: 0\.0 must be a positive finite number"):
        write_kv(k, k, cache, torch.zeros(1, dtype=torch.int64, device=device), k_scale=0.0)


def test_engine_with_an_fp8_cache_on_gpu_gives_the_cpu_emulations_tokens(device, tiny_llama_dir):
    """The Triton path (fused rotary + fp8 write, both attention kernels, CUDA graphs) against the torch
    emulation on the CPU, float32 on both: the same e4m3 cache up to the rounding of K/V themselves, so
    the same greedy tokens but for a rare flip at a near tie (at most one sequence of the six)."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU")
    from modelfleet.dataplane import LLM, SamplingParams

    from tests.dataplane.kernels.test_engine_on_gpu import prompts

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    settings = dict(dtype="float32", max_num_batched_tokens=128, max_num_seqs=4, kv_cache_dtype="fp8")
    gpu = LLM(tiny_llama_dir, device="cuda", **settings)
    assert gpu.engine.runner.kv_cache.dtype == FP8_KV_DTYPE
    assert gpu.engine.runner.decode_graphs is not None
    got = [o.token_ids for o in gpu.generate(prompts(), params)]
    cpu = LLM(tiny_llama_dir, device="cpu", **settings)
    want = [o.token_ids for o in cpu.generate(prompts(), params)]
    # a flip changes the rest of its sequence: count whole sequences
    assert sum(x == y for x, y in zip(got, want, strict=True)) >= len(want) - 1, (got, want)
