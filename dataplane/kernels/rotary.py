"""Rotary position embedding, neox style (HF Llama's rotate_half: the two halves of each head rotate).

With programmatic dependent launch (Hopper and newer) the kernel is scheduled while its predecessor
drains and waits for it (`gdc_wait`) before its first load; it lets its own successor launch at once,
since that one waits for this kernel's completion in turn.
"""

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.kernels.availability import next_power_of_2, pdl_supported


@triton.jit
def _load_cos_sin(
    cos_ptr, sin_ptr, stride_cos, stride_sin, token, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    """One token's cos and sin as float32 rows [1, BLOCK_HALF], broadcast over the heads."""
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    token,
    cos,
    sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotates one token's heads into out; returns the two rotated halves [BLOCK_H, BLOCK_HALF] (x's
    dtype) for callers that store them elsewhere too."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    src = x_ptr + token * stride_xt + heads * stride_xh + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # each product rounds to the model dtype before the sum, as x * cos + rotate_half(x) * sin does;
    # compiled for an H100 the round trips are not all kept (the PTX has fused multiply-adds) and ~20%
    # of fp16 results are an ulp off torch's, so tests hold it to the dtype's tolerance, not the bit
    o1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    dst = out_ptr + token * stride_ot + heads * stride_oh + dims
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if USE_PDL:  # q, k, cos and sin all come from earlier kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cos, sin = _load_cos_sin(cos_ptr, sin_ptr, stride_cos, stride_sin, token, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin, num_heads,
        HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin, num_kv_heads,
        HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


def check_rotary_args(
    name: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """The argument checks of the rotary kernels; `name` is the public function that reports them."""
    half = q.shape[-1] // 2
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"{name}: q, k, cos and sin need a contiguous last dimension")
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"{name}: cos and sin need {half} columns (head_dim / 2), got {cos.shape[-1]}")


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] (strided views of a fused qkv are fine) by cos, sin
    [T, D/2] (in q's dtype, as HF casts them); new tensors, or q and k themselves when `inplace`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    check_rotary_args("rotary_embedding", q, k, cos, sin)
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        use_pdl = pdl_supported(q.device)
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            q_out,
            k_out,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos.stride(0),
            sin.stride(0),
            num_heads,
            num_kv_heads,
            HALF=half,
            BLOCK_HALF=next_power_of_2(half),
            BLOCK_HQ=next_power_of_2(num_heads),
            BLOCK_HK=next_power_of_2(num_kv_heads),
            USE_PDL=use_pdl,
            num_warps=4 if num_heads * head_dim >= 2048 else 1,
            launch_pdl=use_pdl,
        )
    return q_out, k_out
