"""Rotary embedding and KV-cache write in one kernel: the rotated K and the V of each new token go
straight to its slot, saving a launch and a re-read of K per layer (decode is launch-bound at batch 1).

The rotation is rotary.py's `_rotate_heads`, so q and k round exactly as `rotary_embedding` does; the
cache write stores what kv_write.py's `write_kv` would, and skips padding rows (negative slot) alike.
An fp8 cache stores K / k_scale and V / v_scale as kv_write.py does.
Programmatic dependent launch as in rotary.py: wait before the first load, successor released at once.
"""

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.attention.kv_quant import check_scale, is_fp8
from modelfleet.dataplane.kernels.availability import next_power_of_2, pdl_supported
from modelfleet.dataplane.kernels.kv_write import fp8_scaled
from modelfleet.dataplane.kernels.rotary import _load_cos_sin, _rotate_heads, check_rotary_args


@triton.jit
def _cache_value(x, inv_scale, FP8_KV: tl.constexpr):
    """What the cache stores for x, in float32 (exact for x's own dtype): x itself, or x / scale
    saturated for an e4m3 cache. One return type for both, as Triton requires."""
    if FP8_KV:
        return fp8_scaled(x, inv_scale)
    return x.to(tl.float32)


@triton.jit
def _rotary_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    k_inv_scale,
    v_inv_scale,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if USE_PDL:  # q, k, v, cos, sin and the slots come from earlier kernels (or copies)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cos, sin = _load_cos_sin(cos_ptr, sin_ptr, stride_cos, stride_sin, token, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin, num_heads,
        HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    k1, k2 = _rotate_heads(
        k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin, num_kv_heads,
        HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding token (e.g. a CUDA-graph batch filled up to its size)
        heads = tl.arange(0, BLOCK_HK)[:, None]
        dims = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < num_kv_heads) & (dims < HALF)
        dst = (
            (slot // PAGE_SIZE) * stride_cache_block
            + (slot % PAGE_SIZE) * stride_cache_token
            + heads * stride_cache_head
            + dims
        )
        # new names: a value that changes dtype inside this runtime branch may not keep its name
        k_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, _cache_value(k1, k_inv_scale, FP8_KV).to(k_dtype), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, _cache_value(k2, k_inv_scale, FP8_KV).to(k_dtype), mask=mask)
        src = v_ptr + token * stride_vt + heads * stride_vh + dims
        v1 = tl.load(src, mask=mask)
        v2 = tl.load(src + HALF, mask=mask)
        v_dtype = v_cache_ptr.dtype.element_ty
        tl.store(v_cache_ptr + dst, _cache_value(v1, v_inv_scale, FP8_KV).to(v_dtype), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, _cache_value(v2, v_inv_scale, FP8_KV).to(v_dtype), mask=mask)


def rotary_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    inplace: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding(q, k, cos, sin)` then `write_kv(k_rotated, v, kv_cache, slot_mapping)`, in one
    launch and with the same results. q [T, Hq, D], k and v [T, Hkv, D] (strided views of a fused qkv
    are fine), cos/sin [T, D/2], kv_cache [2, num_blocks, block_size, Hkv, D], slot_mapping int64 [T]
    (negative: padding, not written). Returns the rotated (q, k): new tensors, or q and k themselves
    when `inplace`. k_scale / v_scale: the layer's KV scales, used by an fp8 cache only (the returned k
    is the rotated k, not its fp8 rounding). Reads nothing on the host, so it can run inside a captured
    CUDA graph."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    check_rotary_args("rotary_and_write_kv", q, k, cos, sin)
    if v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("rotary_and_write_kv: v and kv_cache need a contiguous last (head_dim) dimension")
    if v.shape != k.shape or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"rotary_and_write_kv: v must have k's shape {tuple(k.shape)} and kv_cache must be "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]; got v {tuple(v.shape)}, "
            f"kv_cache {tuple(kv_cache.shape)}"
        )
    if tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"rotary_and_write_kv: kv_cache holds {tuple(kv_cache.shape[3:])} (heads, head_dim) per slot "
            f"but k is {(num_kv_heads, head_dim)}; pass the cache of this layer"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"rotary_and_write_kv: slot_mapping needs one slot per token ({num_tokens}), "
            f"got shape {tuple(slot_mapping.shape)}"
        )
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    use_pdl = pdl_supported(q.device)
    _rotary_kv_write_kernel[(num_tokens,)](
        q,
        k,
        v,
        q_out,
        k_out,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        1.0 / check_scale("k_scale", k_scale),
        1.0 / check_scale("v_scale", v_scale),
        num_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(num_kv_heads),
        PAGE_SIZE=kv_cache.shape[2],
        USE_PDL=use_pdl,
        FP8_KV=is_fp8(kv_cache),
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
        launch_pdl=use_pdl,
    )
    return q_out, k_out
