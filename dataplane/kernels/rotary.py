"""Rotary position embedding, neox style (HF Llama's rotate_half), applied to q and k in place."""

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.kernels.availability import next_power_of_2


@triton.jit
def _rotate(
    x_ptr,
    stride_t,
    stride_h,
    token,
    cos,
    sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # each product rounds to the model dtype before the sum, as q * cos + rotate_half(q) * sin does
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, o1.to(dtype), mask=mask)
    tl.store(first + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF
    # cos/sin in the model dtype (HF casts them before use), multiplied in float32
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    sin = (
        tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims, mask=dim_mask, other=0.0)
        .to(dtype)
        .to(tl.float32)
    )
    _rotate(
        q_ptr, stride_qt, stride_qh, token, cos[None, :], sin[None, :], num_heads, HALF, BLOCK_HQ, BLOCK_HALF
    )
    _rotate(
        k_ptr,
        stride_kt,
        stride_kh,
        token,
        cos[None, :],
        sin[None, :],
        num_kv_heads,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (views of a fused qkv are fine); returns them.

    cos_sin_cache [max_positions, D]: cos of the D/2 angles, then their sin
    (see reference.rope_cos_sin_cache).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding: q, k and cos_sin_cache need a contiguous last dimension")
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(
            f"rotary_embedding: cos_sin_cache has {cos_sin_cache.shape[-1]} columns, need {head_dim}"
        )
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cos_sin_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            num_heads,
            num_kv_heads,
            HALF=half,
            BLOCK_HALF=next_power_of_2(half),
            BLOCK_HQ=next_power_of_2(num_heads),
            BLOCK_HK=next_power_of_2(num_kv_heads),
            num_warps=4 if num_heads * head_dim >= 2048 else 1,
        )
    return q, k
