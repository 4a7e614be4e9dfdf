"""Prefill / extend attention over the paged KV cache: variable lengths, causal, prefix-cached context.

Sequence b computes q_len = query_start_loc[b+1] - query_start_loc[b] tokens this step; they are the last
q_len of its seq_len tokens, so the first seq_len - q_len are context already in the cache (a prefix-cache
hit or earlier chunks of a chunked prefill). A program owns one tile of BLOCK_Q query tokens of one
sequence for one KV head and packs the query heads of that KV head into the rows of its tile
(BLOCK_M = BLOCK_Q x group), so each K/V tile read from the cache serves the whole group. Decode tokens
in a mixed batch are just sequences with q_len = 1. An fp8 cache is read as decode_attention.py reads it.
"""

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.attention.kv_quant import check_scale, is_fp8
from modelfleet.dataplane.kernels.availability import next_power_of_2

LOG2_E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_index = q_tile * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows // GROUP < BLOCK_Q) & (q_index < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    tokens = (q_start + q_index).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q_pos = context_len + q_index

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # keys past the tile's last query position are masked for every row: stop there
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    # and with a sliding window, keys before the first query's window are masked for every row too
    kv_begin = tl.where(window > 0, tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    for tile_start in range(kv_begin, kv_end, BLOCK_N):
        pos = tile_start + offs_n
        pos_mask = pos < kv_end
        page = tl.load(block_table + pos // PAGE_SIZE, mask=pos_mask, other=0).to(tl.int64)
        kv_rows = (
            page * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_token + kv_head * stride_cache_head
        )
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:
            k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        visible &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # a row that has seen no key yet (possible with a window) keeps m = -inf: shift by 0 instead
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if FP8_KV:
        acc = acc * v_scale
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (all sequences' new tokens, flattened) over the paged KV cache,
    which already holds this step's K/V. `sliding_window` W: keys at positions p-W+1..p only.
    k_scale / v_scale: the layer's KV scales, used by an fp8 cache only."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"extend_attention: {num_heads} query heads are not a multiple of {num_kv_heads}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("extend_attention: q and kv_cache need a contiguous last (head_dim) dimension")
    fp8_kv = is_fp8(kv_cache)
    scale_log2 = scale * LOG2_E * (check_scale("k_scale", k_scale) if fp8_kv else 1.0)
    v_scale = check_scale("v_scale", v_scale)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    wide = q.element_size() > 2 or head_dim > 128
    block_m = max(32 if wide else 64, next_power_of_2(group))
    block_q = block_m // group
    block_n = 32 if wide else 64
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale_log2,
        v_scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_KV=fp8_kv,
        num_warps=4,
        num_stages=2,
    )
    return out
