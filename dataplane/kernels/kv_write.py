"""KV-cache write: each new token's K and V go to its flat slot (block * block_size + offset).

An fp8 (e4m3) cache stores K / k_scale and V / v_scale, saturated to +-448 (attention/kv_quant.py).
"""

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.attention.kv_quant import check_scale, is_fp8
from modelfleet.dataplane.kernels.availability import next_power_of_2


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    k_inv_scale,
    v_inv_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch filled up to its captured size)
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    dst = (
        (slot // PAGE_SIZE) * stride_cache_block
        + (slot % PAGE_SIZE) * stride_cache_token
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8_KV:
        k = fp8_scaled(k, k_inv_scale)
        v = fp8_scaled(v, v_inv_scale)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_scaled(x, inv_scale):
    """x / scale in float32, saturated to e4m3's range; the caller's store rounds it to e4m3."""
    return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v [T, Hkv, D] (last dim contiguous) into kv_cache [2, num_blocks, block_size, Hkv, D].
    k_scale / v_scale: the layer's KV scales, used by an fp8 cache only."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv: k, v and kv_cache need a contiguous last (head_dim) dimension")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        1.0 / check_scale("k_scale", k_scale),
        1.0 / check_scale("v_scale", v_scale),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=kv_cache.shape[2],
        FP8_KV=is_fp8(kv_cache),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
