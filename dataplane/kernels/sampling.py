"""Next-token choice in one pass over the logits: greedy argmax or Gumbel-max sampling, with a NaN check.

Greedy rows (temperature <= 0) get the first index of the row's max, exactly as `torch.argmax`. Sampling
rows get argmax_j(logits_j / T + g_j) with g_j standard Gumbel noise, which is a draw from
softmax(logits / T). The noise of column j comes from Triton's Philox keyed by the row's seed, with a
counter that depends on j alone, so a row's token depends only on its seed and its logits: never on the
other rows, the batch size, or how the vocabulary is split across programs.

With a `TokenBitmask` (structured output's grammar masks, GrammarMasks.finish_bitmask) a column its
row's bitmask does not allow counts as -inf, read from the bitmask as the logits stream by: the masking
costs no launch and no pass of its own.

Two launches: programs (row, chunk) each reduce a slice of the vocabulary to its best (score, column)
and a NaN flag; one small program per row then picks the best chunk. A single 128k row is thus read by
many SMs, and a large batch streams through once. Nothing is read back to the host. With programmatic
dependent launch (Hopper and newer) both are scheduled while their predecessor drains and wait for it
before their first load.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.kernels.availability import next_power_of_2, nvidia_gpu, pdl_supported
from triton.language.extra import libdevice

# Columns per sub-block. One Philox call yields four uniforms, used by four consecutive sub-blocks of a
# tile, so column c takes output (c // SUB) % 4 of counter (c // TILE) * SUB + c % SUB. The layout is a
# constant (not tuned per shape): changing it changes every seed's tokens.
_SUB = 512
_TILE = 4 * _SUB
# The uniforms are kept inside (0, 1): the smallest step of tl.rand is 2^-31, the largest float below 1
# is 1 - 2^-24.
_U_MIN = tl.constexpr(2.0**-32)
_U_MAX = tl.constexpr(1.0 - 2.0**-24)
_INT32_MAX = tl.constexpr(2**31 - 1)
_INV_TEMPERATURE_MAX = tl.constexpr(3.0e38)
# (row, chunk) programs to aim for per SM: enough to fill the GPU when a batch has few rows.
_PROGRAMS_PER_SM = 4
_NUM_WARPS = 4
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class TokenBitmask:
    """Which tokens each row may take: bit g (word g // 32, bit g % 32) of row i allows grammar id g.
    Model ids below `num_direct` are grammar ids as they are; model id `far_ids[j]` past them is grammar
    id num_direct + j; any other id past them is never allowed (a vocabulary padded past its tokenizer:
    structured.GrammarVocab). Only the rows flagged in `masked_rows` are masked."""

    bits: torch.Tensor  # int32 [N, words], on the logits' device
    num_direct: int
    far_ids: torch.Tensor  # int32 [F], on the logits' device (F may be 0)
    masked_rows: torch.Tensor  # int32 [N], on the logits' device: 0 where a row takes any token


@triton.jit
def _allowed(cols, bits_row, num_direct, far_ptr, NUM_FAR: tl.constexpr):
    """Whether the row's bitmask allows each of `cols` (model ids): see TokenBitmask."""
    gid = tl.where(cols < num_direct, cols, -1)
    for j in tl.static_range(NUM_FAR):
        gid = tl.where(cols == tl.load(far_ptr + j), num_direct + j, gid)
    known = gid >= 0
    word = tl.load(bits_row + gid // 32, mask=known, other=0)
    return known & (((word >> (gid % 32)) & 1) != 0)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    # The hardware approximation (relative error about 2^-22) is ample for noise, and the precise log
    # would make the sampling pass compute-bound.
    if FAST_LOG:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
        y = libdevice.fast_logf(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _scores(
    row_ptr,
    cols,
    col_end,
    u,
    inv_temperature,
    mask_args,
    SAMPLE: tl.constexpr,
    FAST_LOG: tl.constexpr,
    MASKED: tl.constexpr,
    NUM_FAR: tl.constexpr,
):
    """Logits (float32) of `cols` and their scores: the logit itself, or logit * (1/T) + Gumbel noise.
    MASKED: a column the row's bitmask does not allow is -inf (so never NaN either); mask_args are the
    row's bitmask, TokenBitmask's num_direct and far ids, and whether the row is free of the mask."""
    x = tl.load(row_ptr + cols, mask=cols < col_end, other=float("-inf")).to(tl.float32)
    if MASKED:
        bits_row, num_direct, far_ptr, free_row = mask_args
        allowed = _allowed(cols, bits_row, num_direct, far_ptr, NUM_FAR) | free_row
        x = tl.where(allowed, x, float("-inf"))
    if SAMPLE:
        u = tl.minimum(tl.maximum(u, _U_MIN), _U_MAX)
        # E = -log(1 - u) is Exponential(1) (as -log(u) is); written this way the small E, which decide
        # the winner, keep the fine resolution tl.rand has near 0. A series below 0.01, where 1 - u
        # would round away most of u.
        series = u * (1.0 + u * (0.5 + u * (0.3333333333 + u * (0.25 + u * 0.2))))
        exponential = tl.where(u < 0.01, series, -_log(1.0 - u, FAST_LOG))
        score = x * inv_temperature - _log(exponential, FAST_LOG)  # g = -log(E) is standard Gumbel
    else:
        score = x
    return x, score


@triton.jit
def _keep_best(best, best_col, nan, x, score, cols):
    # Strictly greater: for equal scores the earlier column (seen first in each lane) stays.
    better = score > best
    best = tl.where(better, score, best)
    best_col = tl.where(better, cols, best_col)
    nan = nan | (x != x).to(tl.int32)
    return best, best_col, nan


@triton.jit
def _chunk_best(
    row_ptr,
    seed,
    inv_temperature,
    col_start,
    col_end,
    mask_args,
    SAMPLE: tl.constexpr,
    SUB: tl.constexpr,
    FAST_LOG: tl.constexpr,
    MASKED: tl.constexpr,
    NUM_FAR: tl.constexpr,
):
    """Best score of columns [col_start, col_end) of one row, its first column, and whether any is NaN."""
    lanes = tl.arange(0, SUB)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_col = tl.zeros([SUB], tl.int32)
    nan = tl.zeros([SUB], tl.int32)
    for tile_start in range(col_start, col_end, 4 * SUB):
        if SAMPLE:
            u0, u1, u2, u3 = tl.rand4x(seed, tile_start // 4 + lanes)
        else:
            unused = tl.zeros([SUB], tl.float32)
            u0, u1, u2, u3 = unused, unused, unused, unused
        # the four sub-blocks in column order, so that each lane meets its columns in increasing order
        cols = tile_start + lanes
        x, score = _scores(
            row_ptr, cols, col_end, u0, inv_temperature, mask_args, SAMPLE, FAST_LOG, MASKED, NUM_FAR
        )
        best, best_col, nan = _keep_best(best, best_col, nan, x, score, cols)
        cols += SUB
        x, score = _scores(
            row_ptr, cols, col_end, u1, inv_temperature, mask_args, SAMPLE, FAST_LOG, MASKED, NUM_FAR
        )
        best, best_col, nan = _keep_best(best, best_col, nan, x, score, cols)
        cols += SUB
        x, score = _scores(
            row_ptr, cols, col_end, u2, inv_temperature, mask_args, SAMPLE, FAST_LOG, MASKED, NUM_FAR
        )
        best, best_col, nan = _keep_best(best, best_col, nan, x, score, cols)
        cols += SUB
        x, score = _scores(
            row_ptr, cols, col_end, u3, inv_temperature, mask_args, SAMPLE, FAST_LOG, MASKED, NUM_FAR
        )
        best, best_col, nan = _keep_best(best, best_col, nan, x, score, cols)
    top = tl.max(best, 0)
    # A lane that saw only -inf keeps column 0, so an all -inf row gives 0, as torch.argmax does.
    col = tl.min(tl.where(best == top, best_col, _INT32_MAX), 0)
    return top, col, tl.max(nan, 0)


# The number of chunks follows the batch size; specializing on it (divisible by 16 or not) would compile
# another variant in the middle of serving the first time a batch of a new kind comes.
@triton.jit(do_not_specialize=["num_chunks"])
def _chunk_kernel(
    logits_ptr,
    temperature_ptr,
    seeds_ptr,
    part_score_ptr,
    part_col_ptr,
    part_nan_ptr,
    bits_ptr,
    far_ptr,
    masked_rows_ptr,
    stride_row,
    stride_bits,
    num_direct,
    vocab,
    chunk_cols,
    num_chunks,
    SUB: tl.constexpr,
    FAST_LOG: tl.constexpr,
    USE_PDL: tl.constexpr,
    MASKED: tl.constexpr,
    NUM_FAR: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    bits_row = bits_ptr + row.to(tl.int64) * stride_bits
    col_start = chunk * chunk_cols
    col_end = tl.minimum(col_start + chunk_cols, vocab)
    if USE_PDL:  # the logits, temperatures and seeds come from earlier kernels (or copies)
        tl.extra.cuda.gdc_wait()
    temperature = tl.load(temperature_ptr + row)
    # a row the bitmask leaves free takes any token (a batch may mix constrained and free rows)
    free_row = False
    if MASKED:
        free_row = tl.load(masked_rows_ptr + row) == 0
    mask_args = (bits_row, num_direct, far_ptr, free_row)
    if temperature > 0:
        seed = tl.load(seeds_ptr + row)
        # capped so that a logit of 0 stays 0 (not 0 * inf) for a vanishing temperature
        inv_temperature = tl.minimum(1.0 / temperature, _INV_TEMPERATURE_MAX)
        score, col, nan = _chunk_best(
            row_ptr,
            seed,
            inv_temperature,
            col_start,
            col_end,
            mask_args,
            True,
            SUB,
            FAST_LOG,
            MASKED,
            NUM_FAR,
        )
    else:
        score, col, nan = _chunk_best(
            row_ptr, 0, 1.0, col_start, col_end, mask_args, False, SUB, FAST_LOG, MASKED, NUM_FAR
        )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot = row * num_chunks + chunk
    tl.store(part_score_ptr + slot, score)
    tl.store(part_col_ptr + slot, col)
    tl.store(part_nan_ptr + slot, nan)


@triton.jit(do_not_specialize=["num_chunks"])
def _reduce_kernel(
    part_score_ptr,
    part_col_ptr,
    part_nan_ptr,
    token_ptr,
    nan_rows_ptr,
    num_chunks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK)
    mask = chunks < num_chunks
    slots = row * num_chunks + chunks
    if USE_PDL:  # the partials are the chunk kernel's output
        tl.extra.cuda.gdc_wait()
    score = tl.load(part_score_ptr + slots, mask=mask, other=float("-inf"))
    col = tl.load(part_col_ptr + slots, mask=mask, other=0)
    nan = tl.load(part_nan_ptr + slots, mask=mask, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    top = tl.max(score, 0)
    token = tl.min(tl.where(score == top, col, _INT32_MAX), 0)  # chunks hold increasing columns
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(nan_rows_ptr + row, tl.max(nan, 0) != 0)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # Triton's interpreter on the CPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_args(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, mask: TokenBitmask | None
) -> None:
    if logits.dim() != 2:
        raise ValueError(
            f"sample_tokens: logits must be 2-D [num_rows, vocab], got shape {tuple(logits.shape)}"
        )
    if logits.dtype not in _DTYPES:
        raise ValueError(f"sample_tokens: logits must be bfloat16, float16 or float32, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("sample_tokens: logits has an empty vocab dimension")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError("sample_tokens: logits needs a contiguous last (vocab) dimension; pass a copy")
    rows = logits.shape[0]
    for name, tensor, dtype in (("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64)):
        if tensor.shape != (rows,) or tensor.dtype != dtype:
            raise ValueError(
                f"sample_tokens: {name} must be {dtype} of shape ({rows},), "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        if tensor.device != logits.device:
            raise ValueError(f"sample_tokens: {name} must be on {logits.device}, like logits")
    if mask is not None:
        _check_mask(mask, logits)


def _check_mask(mask: TokenBitmask, logits: torch.Tensor) -> None:
    rows, vocab = logits.shape
    bits, far = mask.bits, mask.far_ids
    grammar_ids = min(mask.num_direct, vocab) + far.numel()
    if bits.dtype != torch.int32 or bits.dim() != 2 or bits.shape[0] != rows or bits.stride(1) != 1:
        raise ValueError(f"sample_tokens: mask.bits must be int32 [{rows}, words] with contiguous rows")
    if bits.shape[1] * 32 < grammar_ids:
        raise ValueError(
            f"sample_tokens: mask.bits has {bits.shape[1]} words a row, too few for {grammar_ids} ids"
        )
    if far.dtype != torch.int32 or far.dim() != 1:
        raise ValueError("sample_tokens: mask.far_ids must be int32 [F]")
    flags = mask.masked_rows
    if flags.dtype != torch.int32 or flags.shape != (rows,):
        raise ValueError(f"sample_tokens: mask.masked_rows must be int32 [{rows}]")
    if any(t.device != logits.device for t in (bits, far, flags)):
        raise ValueError(f"sample_tokens: the mask must be on {logits.device}, like logits")


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, *, mask: TokenBitmask | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of each row of logits [N, V] (bf16/fp16/fp32, last dim contiguous, any row stride).

    temperature: float32 [N], <= 0 for greedy; seeds: int64 [N], the key of each row's noise (the caller
    makes each (row, step) seed unique). Returns token_ids int64 [N] and nan_rows bool [N] (True where the
    row holds a NaN; its token is then some index in range), both on the logits' device, without any
    host synchronisation (safe inside CUDA-graph capture once compiled). With `mask`, each row chooses
    among the tokens its bitmask allows, as if the others' logits were -inf.
    """
    _check_args(logits, temperature, seeds, mask)
    rows, vocab = logits.shape
    device = logits.device
    token_ids = torch.empty(rows, dtype=torch.int64, device=device)
    nan_rows = torch.empty(rows, dtype=torch.bool, device=device)
    if rows == 0:
        return token_ids, nan_rows
    tiles = triton.cdiv(vocab, _TILE)
    wanted_chunks = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(_device_key(device)), rows)
    tiles_per_chunk = triton.cdiv(tiles, max(1, min(tiles, wanted_chunks)))
    num_chunks = triton.cdiv(tiles, tiles_per_chunk)
    part_score = torch.empty(rows * num_chunks, dtype=torch.float32, device=device)
    part_col = torch.empty(rows * num_chunks, dtype=torch.int32, device=device)
    part_nan = torch.empty(rows * num_chunks, dtype=torch.int32, device=device)
    use_pdl = pdl_supported(_device_key(device))
    _chunk_kernel[(rows, num_chunks)](
        logits,
        temperature.contiguous(),
        seeds.contiguous(),
        part_score,
        part_col,
        part_nan,
        mask.bits if mask is not None else part_nan,  # never read unmasked
        mask.far_ids if mask is not None else part_nan,
        mask.masked_rows if mask is not None else part_nan,
        logits.stride(0),
        mask.bits.stride(0) if mask is not None else 0,
        mask.num_direct if mask is not None else 0,
        vocab,
        tiles_per_chunk * _TILE,
        num_chunks,
        SUB=_SUB,
        FAST_LOG=nvidia_gpu(device),  # libdevice's fast log
        USE_PDL=use_pdl,
        MASKED=mask is not None,
        NUM_FAR=mask.far_ids.numel() if mask is not None else 0,
        num_warps=_NUM_WARPS,
        launch_pdl=use_pdl,
    )
    _reduce_kernel[(rows,)](
        part_score,
        part_col,
        part_nan,
        token_ids,
        nan_rows,
        num_chunks,
        # sized for the vocabulary, not the batch: one compiled variant per model
        BLOCK=next_power_of_2(tiles),
        USE_PDL=use_pdl,
        launch_pdl=use_pdl,
    )
    return token_ids, nan_rows
