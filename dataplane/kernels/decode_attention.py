"""Paged-attention decode: one query token per sequence, split-KV, grouped-query heads packed.

A program owns one (sequence, KV head, split): it loads the query rows of every query head that shares the
KV head (so each K/V tile is read once for the whole group), walks its share of the sequence's KV through
the block table with an online softmax, and either writes the final output (one split) or a partial
output plus its log-sum-exp, which a second small kernel merges. Splitting the KV lets long contexts fill
the GPU when batch x KV heads is small. The split length is derived from each sequence's length inside the
kernel, so the launch shape depends only on sizes, never on data (safe to capture in a CUDA graph).
With programmatic dependent launch (Hopper and newer) both kernels are scheduled while their predecessor
drains, wait for it before their first load, and release their successor once their inputs are read.
An fp8 (e4m3) cache is read as the query's dtype (exact); k_scale folds into the scores' scale and
v_scale multiplies the output, so nothing is dequantized element by element.
"""

import functools
import math

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.attention.kv_quant import check_scale, is_fp8
from modelfleet.dataplane.kernels.availability import next_power_of_2, pdl_supported

LOG2_E = 1.4426950408889634
# Measured on an H100 (graph-replayed, so without launch gaps): at batch 1 and a 257-token context, 16
# splits of 32-token tiles run in 5.1 us against 7.3 us for 2 splits of 64; long contexts are limited
# by the occupancy target instead.
MIN_TOKENS_PER_SPLIT = 32
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    v_scale,
    num_splits,
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
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    if USE_PDL:  # q, the new K/V, the lengths and the block table come from earlier kernels (or copies)
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    # a sliding window of W keeps only the last W keys (the query sits at position seq_len - 1)
    kv_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    start = kv_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + group
    head_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        pos_mask = pos < end
        page = tl.load(block_table + pos // PAGE_SIZE, mask=pos_mask, other=0).to(tl.int64)
        rows = (
            page * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_token + kv_head * stride_cache_head
        )
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:
            k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if FP8_KV:  # the merge of splits is linear in their outputs: scaling each part scales the result
        acc = acc * v_scale
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if ONE_SPLIT:
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partials: out [B, Hq, S, D] and lse [B, Hq, S], both contiguous, lse in log2 units
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    if USE_PDL:  # the partials are the split kernel's output
        tl.extra.cuda.gdc_wait()
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    row = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + row, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a sequence with no keys: output zeros
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    total = tl.sum(weights, 0)
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter on the CPU: size as for a large GPU
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Enough splits to give the GPU ~2 programs per SM, none shorter than MIN_TOKENS_PER_SPLIT."""
    programs = num_seqs * num_kv_heads
    by_occupancy = math.ceil(2 * sm_count / max(programs, 1))
    by_length = math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(by_occupancy, by_length, MAX_SPLITS))
    return next_power_of_2(splits) if splits > 1 else 1


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one query token per sequence (token query_start_loc[b] of q [T, Hq, D]) over its KV.

    `sliding_window` W: each query sees only keys at positions p-W+1..p.
    `max_seq_len` only steers the number of splits (default: the block table's capacity, which stays
    fixed for a captured CUDA graph); `num_splits` overrides the choice. `block_n` (KV tokens per tile),
    `num_warps` and `num_stages` are tuning knobs. k_scale / v_scale: the layer's KV scales, used by
    an fp8 cache only.
    """
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"decode_attention: {num_heads} query heads are not a multiple of {num_kv_heads}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("decode_attention: q and kv_cache need a contiguous last (head_dim) dimension")
    fp8_kv = is_fp8(kv_cache)
    # the score scale with k_scale folded in (exactly the old value without an fp8 cache)
    scale_log2 = scale * LOG2_E * (check_scale("k_scale", k_scale) if fp8_kv else 1.0)
    v_scale = check_scale("v_scale", v_scale)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    capacity = block_tables.shape[1] * page_size if max_seq_len is None else max_seq_len
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, num_sms(q.device))
    one_split = num_splits == 1
    if one_split:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = next_power_of_2(head_dim)
    if block_n is None:  # short splits waste less of a smaller tile
        short_splits = math.ceil(capacity / num_splits) <= 64
        block_n = 32 if short_splits or q.element_size() > 2 else 64
    use_pdl = pdl_supported(q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        scale_log2,
        v_scale,
        num_splits,
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
        BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        ONE_SPLIT=one_split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_PDL=use_pdl,
        FP8_KV=fp8_kv,
        num_warps=num_warps,
        num_stages=num_stages or (3 if q.element_size() <= 2 else 2),
        launch_pdl=use_pdl,
    )
    if not one_split:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            query_start_loc,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(num_splits),
            USE_PDL=use_pdl,
            num_warps=4 if head_dim * num_splits >= 2048 else 2,
            launch_pdl=use_pdl,
        )
    return out
