"""GEMV for small-batch decode linears: y [M, N] = x [M, K] @ W.T (+ b) with M of a few tokens.

At decode a linear is bound by reading its weight once, and cuBLAS's small-M GEMMs reach only 1.3 to 2.8
TB/s of the device's ~3 TB/s. Here each program owns BLOCK_N weight rows (1 to 4 on the decode shapes:
small row blocks put the most loads in flight) and streams them in BLOCK_K-wide vectorised loads, one tile
ahead, with up to 4 rows of x riding along, one fp32 accumulator each. The first weight tile is loaded
before the program waits for the previous kernel (programmatic dependent launch, Hopper and newer), since
weights never depend on it. For shapes too narrow to fill the GPU, K can be split over SPLIT_K programs
whose fp32 partial sums a second small kernel adds up (deterministic; no zeroed buffer to memset); on the
Llama decode shapes the row blocks alone give enough programs and no split wins. The output is rounded
once to x's dtype, as F.linear's is. The launch configuration is fixed per (M, N, K), so calls are
CUDA-graph capturable.

The same kernel reads 1-byte quantized weights (int8, or float8 e4m3 on GPUs that have it) with float32
per-output-channel scales (modelfleet.dataplane.quantization's format): each weight tile is loaded as
4-byte words and decoded to float32 in registers by bit operations (see _byte_to_f32), the activations
stay in bf16/fp16, and the finished fp32 row sums are multiplied by their channel's scale once, before
the bias. Half the bytes of bf16 cross from memory, which is what bounds a decode linear. A tile's bytes
are taken as its 4 byte places (byte j of word c is column 4c + j), and x is read as one contiguous run
of K a thread and split into the same 4 places in registers (_row_dot), rather than loaded one strided
element per byte place; on an NVIDIA GPU int8 bytes are decoded by byte permutes (PTX). On an H200 that
took the GPU time of a batch-1 decode step with int8 weights from 0.80 to 0.69 ms (1B) and from 3.59 to
2.80 ms (8B): docs/benchmarks.md, 2026-11-28.

With silu_mul=True x is a gated MLP's [gate | up] ([M, 2K], the gate_up projection's output) and the
kernel multiplies silu(gate) * up, computed per tile as it is loaded (silu_and_mul_f32, shared with the
activation kernel) and rounded to x's dtype as that kernel stores it: the down projection reads gate_up
directly, saving the activation kernel's launch and round trip, with the same products. Every row block
recomputes the activation of its K range, so at least SILU_MUL_MIN_BLOCK_N weight rows share it: at one row
per program its exp and division (two special-function operations per weight) would, by estimate, take
about as long as streaming bf16 weights does (not yet timed against one row).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.kernels.activation import silu_and_mul_f32
from modelfleet.dataplane.kernels.availability import next_power_of_2, nvidia_gpu, pdl_supported

NUM_SMS_FALLBACK = 132
MAX_ROWS_PER_PROGRAM = 4  # rows of x one program multiplies (more rows: more programs along M)
QUANTIZED_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)  # read with per-channel scales
SILU_MUL_MIN_BLOCK_N = 4  # weight rows per program that share the fused activation's exp and division
# A packed e4m3 weight decodes to its value times 2**-120 (_byte_to_f32). The products take the 2**120 back
# as x times 2**64 and the finished sums times 2**56: powers of two, so exact, and every product stays a
# normal float32 (a product of the decoded weight and x alone would often be subnormal).
FP8_X_SCALE = tl.constexpr(2.0**64)
# An int8 byte offset to 0..255 in the low mantissa bits of 2**23 reads as 2**23 + 128 + byte (_byte_to_f32).
INT8_BIAS = tl.constexpr(8388736.0)
FP8_OUT_SCALE = tl.constexpr(2.0**56)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per program
    block_k: int  # elements of each row loaded per iteration
    num_warps: int
    split_k: int = 1  # programs sharing one row block's K range
    reduce_at_end: bool = False  # keep [BLOCK_N, BLOCK_K] accumulators, reduced once after the loop
    use_pdl: bool = True  # programmatic dependent launch: load weights while the previous kernel finishes
    decode_bits: bool = True  # 1-byte weights: decoded by bit operations on 4-byte words, not by conversions


@triton.jit
def _load_x(ptrs, cols, k_end, row_ok, EVEN_K: tl.constexpr, MASK_M: tl.constexpr):
    if EVEN_K:
        if MASK_M:
            x = tl.load(ptrs, mask=row_ok, other=0.0, eviction_policy="evict_last")
        else:
            x = tl.load(ptrs, eviction_policy="evict_last")
    else:
        x = tl.load(ptrs, mask=(cols < k_end) & row_ok, other=0.0, eviction_policy="evict_last")
    return x


@triton.jit
def _byte_to_f32(words, j: tl.constexpr, FP8: tl.constexpr):
    """Byte j of each int32 word as float32, without a conversion instruction: those issue at a quarter
    of the ALU rate and bound a GEMV that streams 1-byte weights at full memory bandwidth.
    int8: the byte, offset to 0..255, becomes the low mantissa bits of 2**23 (the 2**23 + 128 comes off
    again). float8 e4m3: the byte moved to the top of the word and shifted back 4 places with its sign
    repeated puts exponent and mantissa in their float32 places; the mask keeps one sign bit. That reads
    as the value times 2**-120 (exponent bias 127 against 7; subnormals land on float32 subnormals): the
    kernel takes that factor back outside the loop (FP8_X_SCALE, FP8_OUT_SCALE), not once per weight."""
    if FP8:
        top = words if j == 3 else words << (24 - 8 * j)
        bits = (top >> 4) & -2014314496  # 0x87F00000 as int32: the sign, 4 exponent and 3 mantissa bits
        return bits.to(tl.float32, bitcast=True)
    byte = (words >> (8 * j)) & 0xFF
    return (byte ^ 0x4B000080).to(tl.float32, bitcast=True) - INT8_BIAS


@triton.jit
def _int8_bytes_biased(words):
    """The 4 bytes of each int32 word of int8 weights as the float32 bits of 2**23 + 128 + byte, by PTX:
    one xor a word (the bytes offset to 0..255) and one byte permute a byte, which moves the byte into the
    low bits of 2**23's pattern (where _byte_to_f32's arithmetic takes an extract and a xor)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 u, m;
        xor.b32 u, $4, 0x80808080;
        mov.b32 m, 0x4B000000;
        prmt.b32 $0, u, m, 0x7650;
        prmt.b32 $1, u, m, 0x7651;
        prmt.b32 $2, u, m, 0x7652;
        prmt.b32 $3, u, m, 0x7653;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[words],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _packed_parts(w, FP8: tl.constexpr, PTX: tl.constexpr):
    """A packed tile's 4 byte places in float32: part j holds byte j of each word. PTX: int8 bytes decoded
    by _int8_bytes_biased (an NVIDIA GPU; Triton's interpreter runs no PTX)."""
    if PTX and not FP8:
        q0, q1, q2, q3 = _int8_bytes_biased(w)
        b0 = q0.to(tl.float32, bitcast=True) - INT8_BIAS
        b1 = q1.to(tl.float32, bitcast=True) - INT8_BIAS
        b2 = q2.to(tl.float32, bitcast=True) - INT8_BIAS
        b3 = q3.to(tl.float32, bitcast=True) - INT8_BIAS
    else:
        b0 = _byte_to_f32(w, 0, FP8)
        b1 = _byte_to_f32(w, 1, FP8)
        b2 = _byte_to_f32(w, 2, FP8)
        b3 = _byte_to_f32(w, 3, FP8)
    return b0, b1, b2, b3


@triton.jit
def _x_row(
    x_ptrs,
    gw,
    ss,
    cols,
    k_end,
    row_ok,
    K,
    EVEN_K: tl.constexpr,
    MASK_M: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,
    X_SCALE: tl.constexpr,
):
    """One row of x at `cols` in float32, as the products take it (SILU_MUL: silu(gate) * up, the row being
    [gate | up] with up K elements after gate; NORM: times gw, the norm's weight, x's squares added to ss;
    then times X_SCALE)."""
    x = _load_x(x_ptrs + cols, cols, k_end, row_ok, EVEN_K, MASK_M)
    if SILU_MUL:
        up = _load_x(x_ptrs + K + cols, cols, k_end, row_ok, EVEN_K, MASK_M)
        # rounded to x's dtype as the unfused activation is stored, so the products are the same
        xf = silu_and_mul_f32(x, up).to(x.dtype).to(tl.float32)
    else:
        xf = x.to(tl.float32)
    if NORM:
        ss += xf * xf
        xf = xf * gw
    if X_SCALE != 1.0:
        xf = xf * X_SCALE
    return xf, ss


@triton.jit
def _row_dot(
    acc,
    ss,
    w0,
    w1,
    w2,
    w3,
    gw,
    x_ptrs,
    cols,
    k_end,
    row_ok,
    K,
    EVEN_K: tl.constexpr,
    MASK_M: tl.constexpr,
    AT_END: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,
    X_SCALE: tl.constexpr,
    PARTS: tl.constexpr,
):
    """acc + a weight tile (fp32) times one row of x at `cols` (as _x_row takes it). PARTS: the tile is a
    packed one's 4 byte places [BLOCK_N, BLOCK_W] (w0..w3, byte j of word c being column 4c + j), and x,
    read as one contiguous run of 4 * BLOCK_W columns, is split into its 4 places in registers; else w0 is
    the whole tile [BLOCK_N, BLOCK_K]."""
    xf, ss = _x_row(x_ptrs, gw, ss, cols, k_end, row_ok, K, EVEN_K, MASK_M, SILU_MUL, NORM, X_SCALE)
    if PARTS:
        even, odd = tl.split(tl.reshape(xf, (w0.shape[1], 2, 2)))  # x[4c + 2p] and x[4c + 2p + 1]
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        prod = w0 * x0[None, :]
        prod += w1 * x1[None, :]
        prod += w2 * x2[None, :]
        prod += w3 * x3[None, :]
    else:
        prod = w0 * xf[None, :]
    if not AT_END:
        prod = tl.sum(prod, axis=1)
    return acc + prod, ss


@triton.jit
def _rows_dot(
    acc0,
    acc1,
    acc2,
    acc3,
    ss0,
    ss1,
    ss2,
    ss3,
    w0,
    w1,
    w2,
    w3,
    x_rows,
    stride_xm,
    norm_ptr,
    cols,
    k_end,
    m0,
    M,
    K,
    BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    MASK_M: tl.constexpr,
    AT_END: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,
    X_SCALE: tl.constexpr,
    PARTS: tl.constexpr,
):
    """One fp32 weight tile (see _row_dot) times up to 4 rows of x (the columns of x at `cols`)."""
    gw = 0.0
    if NORM:  # the norm's weight at these columns, shared by the rows
        gw = _load_x(norm_ptr + cols, cols, k_end, True, EVEN_K, False).to(tl.float32)
    acc0, ss0 = _row_dot(
        acc0,
        ss0,
        w0,
        w1,
        w2,
        w3,
        gw,
        x_rows,
        cols,
        k_end,
        m0 < M,
        K,
        EVEN_K,
        MASK_M,
        AT_END,
        SILU_MUL,
        NORM,
        X_SCALE,
        PARTS,
    )
    if BLOCK_M > 1:
        x1 = x_rows + stride_xm
        acc1, ss1 = _row_dot(
            acc1,
            ss1,
            w0,
            w1,
            w2,
            w3,
            gw,
            x1,
            cols,
            k_end,
            m0 + 1 < M,
            K,
            EVEN_K,
            MASK_M,
            AT_END,
            SILU_MUL,
            NORM,
            X_SCALE,
            PARTS,
        )
    if BLOCK_M > 2:
        x2 = x_rows + 2 * stride_xm
        acc2, ss2 = _row_dot(
            acc2,
            ss2,
            w0,
            w1,
            w2,
            w3,
            gw,
            x2,
            cols,
            k_end,
            m0 + 2 < M,
            K,
            EVEN_K,
            MASK_M,
            AT_END,
            SILU_MUL,
            NORM,
            X_SCALE,
            PARTS,
        )
    if BLOCK_M > 3:
        x3 = x_rows + 3 * stride_xm
        acc3, ss3 = _row_dot(
            acc3,
            ss3,
            w0,
            w1,
            w2,
            w3,
            gw,
            x3,
            cols,
            k_end,
            m0 + 3 < M,
            K,
            EVEN_K,
            MASK_M,
            AT_END,
            SILU_MUL,
            NORM,
            X_SCALE,
            PARTS,
        )
    return acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3


@triton.jit
def _store_row(
    acc,
    ss,
    m,
    M,
    rows,
    N,
    K,
    eps,
    out_ptr,
    bias_ptr,
    scale_ptr,
    stride_om,
    pid_k,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PARTIAL: tl.constexpr,
    AT_END: tl.constexpr,
    NORM: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    OUT_SCALE: tl.constexpr,
):
    if AT_END:
        acc = tl.sum(acc, axis=1)
    if OUT_SCALE != 1.0:
        acc *= OUT_SCALE
    mask = (rows < N) & (m < M)
    if PARTIAL:  # fp32 partial sums laid out [SPLIT_K, M, N], scaled once they are added up
        tl.store(out_ptr + (pid_k * M + m) * N + rows, acc, mask=mask)
    else:
        if NORM:  # the row's 1 / rms, known once all of K was swept, scales the finished sums
            acc *= tl.rsqrt(tl.sum(ss, 0) / K + eps)
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + rows, mask=rows < N, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        if ADD_RESIDUAL:  # the output is the residual, read and written by this program alone
            acc += tl.load(out_ptr + m * stride_om + rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + rows, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    scale_ptr,
    out_ptr,
    norm_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    REDUCE_AT_END: tl.constexpr,
    USE_PDL: tl.constexpr,
    PACKED: tl.constexpr,
    FP8: tl.constexpr,
    PTX: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    # SILU_MUL: x's rows are [gate | up] (2K wide) and the activation is silu(gate) * up
    # NORM: x is RMS-normalized with the weight at norm_ptr: the sums are of x * weight, and the squares
    # of x, gathered along the same sweep of K, give the 1 / rms that scales them at the end
    # ADD_RESIDUAL: out_ptr holds the residual, and the result is added to it
    # PACKED: w_ptr is the 1-byte weight seen as int32 words, 4 weights each; a tile is BLOCK_K // 4 words
    PACK: tl.constexpr = 4 if PACKED else 1
    X_SCALE: tl.constexpr = FP8_X_SCALE if PACKED and FP8 else 1.0
    OUT_SCALE: tl.constexpr = FP8_OUT_SCALE if PACKED and FP8 else 1.0
    BLOCK_W: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # the last block's rows past N re-read row N - 1 rather than masking every load; their sums are dropped
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m0.to(tl.int64) * stride_xm
    offs_w = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_end = k_end // PACK
    # up to 4 rows of x, each with its own accumulator (one weight tile feeds them all)
    if REDUCE_AT_END:
        acc0 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = acc0  # (only the first BLOCK_M are used)
    acc2 = acc0
    acc3 = acc0
    ss0 = tl.zeros([BLOCK_K], dtype=tl.float32)  # each row's squares, for NORM (as x is read)
    ss1 = ss0
    ss2 = ss0
    ss3 = ss0
    # The first weight tile is loaded before waiting for the previous kernel (programmatic dependent
    # launch): the weights never depend on it, only x does. Later tiles are loaded one iteration ahead.
    cols = k_start // PACK + offs_w
    if EVEN_K:
        w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    else:
        w = tl.load(
            w_rows + cols[None, :], mask=cols[None, :] < w_end, other=0.0, eviction_policy="evict_first"
        )
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        # every program is resident by the time all have passed here, so the next kernel's programs only
        # take free slots: releasing it now rather than after the loop measured 914 vs 910 tokens/s (1B)
        tl.extra.cuda.gdc_launch_dependents()
    for k in range(k_start, k_end, BLOCK_K):
        cols = k // PACK + offs_w
        ahead = cols + BLOCK_W
        if EVEN_K:
            w_next = tl.load(
                w_rows + ahead[None, :], mask=k + BLOCK_K < k_end, other=0.0, eviction_policy="evict_first"
            )
        else:
            w_next = tl.load(
                w_rows + ahead[None, :], mask=ahead[None, :] < w_end, other=0.0, eviction_policy="evict_first"
            )
        if PACKED:
            w0, w1, w2, w3 = _packed_parts(w, FP8, PTX)
        else:
            w0 = w.to(tl.float32)
            w1 = w0  # (unused)
            w2 = w0
            w3 = w0
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = _rows_dot(
            acc0,
            acc1,
            acc2,
            acc3,
            ss0,
            ss1,
            ss2,
            ss3,
            w0,
            w1,
            w2,
            w3,
            x_rows,
            stride_xm,
            norm_ptr,
            k + offs_k,
            k_end,
            m0,
            M,
            K,
            BLOCK_M,
            EVEN_K,
            MASK_M,
            REDUCE_AT_END,
            SILU_MUL,
            NORM,
            X_SCALE,
            PACKED,
        )
        w = w_next
    _store_row(
        acc0,
        ss0,
        m0,
        M,
        rows,
        N,
        K,
        eps,
        out_ptr,
        bias_ptr,
        scale_ptr,
        stride_om,
        pid_k,
        HAS_BIAS,
        HAS_SCALE,
        PARTIAL,
        REDUCE_AT_END,
        NORM,
        ADD_RESIDUAL,
        OUT_SCALE,
    )
    if BLOCK_M > 1:
        _store_row(
            acc1,
            ss1,
            m0 + 1,
            M,
            rows,
            N,
            K,
            eps,
            out_ptr,
            bias_ptr,
            scale_ptr,
            stride_om,
            pid_k,
            HAS_BIAS,
            HAS_SCALE,
            PARTIAL,
            REDUCE_AT_END,
            NORM,
            ADD_RESIDUAL,
            OUT_SCALE,
        )
    if BLOCK_M > 2:
        _store_row(
            acc2,
            ss2,
            m0 + 2,
            M,
            rows,
            N,
            K,
            eps,
            out_ptr,
            bias_ptr,
            scale_ptr,
            stride_om,
            pid_k,
            HAS_BIAS,
            HAS_SCALE,
            PARTIAL,
            REDUCE_AT_END,
            NORM,
            ADD_RESIDUAL,
            OUT_SCALE,
        )
    if BLOCK_M > 3:
        _store_row(
            acc3,
            ss3,
            m0 + 3,
            M,
            rows,
            N,
            K,
            eps,
            out_ptr,
            bias_ptr,
            scale_ptr,
            stride_om,
            pid_k,
            HAS_BIAS,
            HAS_SCALE,
            PARTIAL,
            REDUCE_AT_END,
            NORM,
            ADD_RESIDUAL,
            OUT_SCALE,
        )


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    bias_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (s * M + m) * N + cols, mask=mask, other=0.0)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _cfg(
    block_n: int, block_k: int = 1024, reduce_at_end: bool = True, use_pdl: bool = True, num_warps: int = 4
) -> GemvConfig:
    return GemvConfig(block_n, block_k, num_warps, reduce_at_end=reduce_at_end, use_pdl=use_pdl)


# Fastest per (N, K, rows of x) on an H100 (bf16, CUDA-graph replay, `bench/gemv.py --sweep`): the
# Llama-3.2-1B and Llama-3-8B decode linears (fused qkv, o, fused gate_up, down; an untied 8B lm_head).
# The runners-up were within a few percent; small row blocks win because they give the most loads in flight.
TUNED: dict[tuple[int, int, int], GemvConfig] = {
    (3072, 2048, 1): _cfg(4, 512),
    (2048, 2048, 1): _cfg(2),
    (16384, 2048, 1): _cfg(2),
    (2048, 8192, 1): _cfg(1, 512),
    (6144, 4096, 1): _cfg(1, 512),
    (4096, 4096, 1): _cfg(1, 512),
    (28672, 4096, 1): _cfg(4),
    (4096, 14336, 1): _cfg(1),
    (128256, 4096, 1): _cfg(16, 512),
    (3072, 2048, 2): _cfg(4, 512),
    (2048, 2048, 2): _cfg(2),
    (16384, 2048, 2): _cfg(4, use_pdl=False),
    (2048, 8192, 2): _cfg(2),
    (6144, 4096, 2): _cfg(8, 256),
    (4096, 4096, 2): _cfg(8, 512),
    (28672, 4096, 2): _cfg(4, use_pdl=False),
    (4096, 14336, 2): _cfg(2),
    (128256, 4096, 2): _cfg(16, 256, use_pdl=False),
}


# Fastest for 1-byte weights with scales at one row of x, as the decode layer calls each GEMV (the norm in
# qkv and gate_up, the residual add in o, SiLU-and-mul and the residual add in down: `bench/gemv.py
# --as-model --sweep --weight-dtype int8`, and fp8, on an H200, 2026-11-28): the config taken is the one
# furthest from neither format's fastest (within 4% of both). The bytes are decoded in registers, so more
# rows per program than for bf16 pay: they share each load of x. Where the sweep found nothing faster than
# the H100 sweep's config by more than its noise (the 8B o, down and lm_head), that config stays.
TUNED_ONE_BYTE: dict[tuple[int, int, int], GemvConfig] = {
    (3072, 2048, 1): _cfg(8, 1024),
    (2048, 2048, 1): _cfg(8, 2048, reduce_at_end=False),
    (16384, 2048, 1): _cfg(16, 512),
    (2048, 8192, 1): _cfg(16, 2048, num_warps=8),
    (128256, 2048, 1): _cfg(16, 512),  # the 1B's tied embeddings as a quantized lm_head
    (6144, 4096, 1): _cfg(16, 1024, reduce_at_end=False),
    (4096, 4096, 1): _cfg(16, 1024, num_warps=8),
    (28672, 4096, 1): _cfg(16, 512),
    (4096, 14336, 1): _cfg(16, 1024, num_warps=8),
    (128256, 4096, 1): _cfg(16, 512),
}


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return NUM_SMS_FALLBACK
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(
    m: int, n: int, k: int, num_sms: int = NUM_SMS_FALLBACK, weight_bytes: int = 2, silu_mul: bool = False
) -> GemvConfig:
    """The tuned configuration of a known shape, else the pattern the tuned ones share: 1024-wide K
    tiles, 4 warps, and the widest row block that still gives every SM ~4 programs (K split if none does).

    1-byte weights (weight_bytes=1) take their own tuned table first (one row of x). With silu_mul (the
    activation fused in) the row block is at least SILU_MUL_MIN_BLOCK_N rows."""
    config = _shape_config(m, n, k, num_sms, weight_bytes)
    if silu_mul and config.block_n < SILU_MUL_MIN_BLOCK_N:
        return dataclasses.replace(config, block_n=SILU_MUL_MIN_BLOCK_N)
    return config


def _shape_config(m: int, n: int, k: int, num_sms: int, weight_bytes: int) -> GemvConfig:
    rows = min(m, MAX_ROWS_PER_PROGRAM)
    tuned = (TUNED_ONE_BYTE if weight_bytes == 1 else {}).get((n, k, rows)) or TUNED.get((n, k, rows))
    if tuned is not None:
        return tuned
    block_k = max(64, min(1024 // next_power_of_2(rows), next_power_of_2(k)))
    block_n = next((bn for bn in (8, 4, 2) if triton.cdiv(n, bn) >= 4 * num_sms), 1)
    split_k = 1
    while (
        triton.cdiv(n, block_n) * split_k < 2 * num_sms and k // (2 * split_k) >= 2 * block_k and split_k < 8
    ):
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=4, split_k=split_k, reduce_at_end=True)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) for a few rows of x; weight [N, K] with contiguous rows.

    With `scale` (float32 [N]), weight is int8 or float8_e4m3fn standing for weight * scale[:, None];
    x stays bf16/fp16 and the output is in x's dtype.

    silu_mul: x is [..., 2K], a gated MLP's [gate | up], and the product is silu_and_mul(x) @ weight.T,
    the activation computed on the fly: equal to running the silu_and_mul kernel first at the same `config`
    (the default one may take wider row blocks, summing in another order).

    norm (norm_weight [K], eps): the product is rms_norm(x) * norm_weight @ weight.T, the norm computed in
    the same sweep of K (float32 throughout, where the norm kernel rounds its output to x's dtype first).
    residual [..., N] in x's dtype: the product is added to it, in place, and residual is returned.
    Either one keeps K whole in each program (no split)."""
    if silu_mul and x.shape[-1] % 2:
        raise ValueError(f"gemv: silu_mul needs x [..., 2K] ([gate | up]), got last dim {x.shape[-1]}")
    if silu_mul and norm is not None:
        raise ValueError("gemv: norm and silu_mul do not go together (a norm's input is the linear's x)")
    k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k:
        what = "half of x's last dim (silu_mul)" if silu_mul else "x's last dim"
        raise ValueError(f"gemv: weight must be [N, {k}] to match {what}, got {list(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: weight needs contiguous rows (stride 1 along K)")
    if scale is not None:
        if weight.dtype not in QUANTIZED_WEIGHT_DTYPES:
            raise ValueError(f"gemv: a scale goes with an int8 or float8_e4m3fn weight, not {weight.dtype}")
        if scale.shape != (n,) or scale.dtype != torch.float32 or scale.stride(0) != 1:
            raise ValueError(
                f"gemv: scale must be contiguous float32 [{n}], got {scale.dtype} {list(scale.shape)}"
            )
    elif weight.dtype in QUANTIZED_WEIGHT_DTYPES:
        raise ValueError(f"gemv: a {weight.dtype} weight needs its per-channel scale")
    elif x.dtype != weight.dtype:
        raise ValueError(f"gemv: x is {x.dtype} but weight is {weight.dtype}; cast one of them")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias must be [{n}], got {list(bias.shape)}")
    if norm is not None and (norm[0].shape != (k,) or not norm[0].is_contiguous()):
        raise ValueError(f"gemv: the norm's weight must be contiguous [{k}], got {list(norm[0].shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if residual is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        want = (*x.shape[:-1], n)
        if residual.shape != want or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(
                f"gemv: residual must be {x.dtype} {list(want)} with a contiguous last dim, got "
                f"{residual.dtype} {list(residual.shape)}"
            )
        out = residual.view(m, n)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    if k == 0:
        if residual is None:
            out.zero_()
        return out.add_(bias if bias is not None else 0).reshape(*x.shape[:-1], n)
    cfg = config or default_config(m, n, k, _num_sms(x.device), weight.element_size(), silu_mul)
    if norm is not None or residual is not None:
        cfg = dataclasses.replace(cfg, split_k=1)  # the norm needs all of K; the add, the whole sums
    if cfg.block_n & (cfg.block_n - 1) or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"gemv: block_n and block_k must be powers of 2, got {cfg}")
    rows_per_program = min(m, MAX_ROWS_PER_PROGRAM)
    block_k = min(cfg.block_k, max(16, next_power_of_2(k)))
    split_k = max(1, min(cfg.split_k, triton.cdiv(k, block_k)))
    # each split gets a whole number of BLOCK_K tiles, so only the very end of K can be ragged
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    partial = split_k > 1
    target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    scale_arg = scale if scale is not None else out  # never read without HAS_SCALE
    # the PDL instructions are compiled in wherever PDL exists (the wait is a no-op in a kernel launched
    # without it, and the trigger lets a PDL-launched successor start early either way)
    pdl = pdl_supported(x.device)
    # 1-byte weights are read as 4-byte words and decoded by bit operations where rows are whole words
    whole_words = k % 4 == 0 and weight.stride(0) % 4 == 0 and weight.storage_offset() % 4 == 0
    packed = scale is not None and cfg.decode_bits and whole_words and block_k >= 64
    w_arg = weight.view(torch.int32) if packed else weight
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, rows_per_program))
    norm_arg = norm[0] if norm is not None else out  # never read without NORM
    _gemv_kernel[grid](
        x2,
        w_arg,
        bias_arg,
        scale_arg,
        target,
        norm_arg,
        m,
        n,
        k,
        x2.stride(0),
        w_arg.stride(0),
        out.stride(0),
        k_per_split,
        norm[1] if norm is not None else 0.0,
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        PARTIAL=partial,
        BLOCK_M=rows_per_program,
        MASK_M=m % rows_per_program != 0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        REDUCE_AT_END=cfg.reduce_at_end,
        USE_PDL=pdl,
        PACKED=packed,
        FP8=weight.dtype == torch.float8_e4m3fn,
        PTX=nvidia_gpu(x.device),
        SILU_MUL=silu_mul,
        NORM=norm is not None,
        ADD_RESIDUAL=residual is not None,
        num_warps=cfg.num_warps,
        launch_pdl=cfg.use_pdl and pdl,
    )
    if partial:
        block = min(1024, next_power_of_2(n))
        _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
            target,
            bias_arg,
            scale_arg,
            out,
            m,
            n,
            out.stride(0),
            SPLIT_K=split_k,
            HAS_BIAS=bias is not None,
            HAS_SCALE=scale is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out.reshape(*x.shape[:-1], n)
