"""Plain-torch references for every kernel of this package: the oracles the GPU tests compare against.

They follow the arithmetic of Hugging Face Llama (where it rounds to the model dtype, so do they) and are
written to be obviously right rather than fast.
KV cache layout (one layer): [2, num_blocks, block_size, num_kv_heads, head_dim]; K is [0], V is [1].
"""

import torch


def write_kv_native(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, Hkv, D] at flat slots (block * block_size + offset); a negative slot is padding."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(kv_cache.dtype)


def gather_kv_native(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [seq_len, Hkv, D] of one sequence, read through its block table."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table.long()[positions // block_size]
    offsets = positions % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def paged_attention_native(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged KV cache (prefill, chunked prefill and decode).

    The query tokens of sequence b are the last `q_len` of its `seq_len` tokens; each attends to
    KV positions 0..its own position (p-W+1..p with a sliding window W). Computed in float32, returned
    in q's dtype.
    """
    num_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_seq = q[starts[b] : starts[b + 1]].float()
        q_len = q_seq.shape[0]
        if q_len == 0:
            continue
        k, v = gather_kv_native(kv_cache, block_tables[b], seq_len)
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_seq, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if sliding_window:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def rms_norm_native(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., H]; with `residual`, normalises x + residual and also returns that sum."""
    if residual is not None:
        x = x + residual
        summed = x
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * hidden.to(x.dtype)
    return out if residual is None else (out, summed)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] of each position's angles: float32 math, then cast to the model dtype (as HF)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_embedding_native(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation (HF Llama's rotate_half) of q [T, Hq, D] and k [T, Hkv, D] by cos, sin
    [T, D/2]; out of place."""
    half = cos.shape[-1]
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], as HF's Llama MLP rounds it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def bitmask_allowed(mask, vocab: int) -> torch.Tensor:
    """bool [N, vocab]: the model ids each row of a sampling.TokenBitmask allows, id by id (all of them
    in a row it leaves free)."""
    ids = torch.arange(vocab)
    grammar_ids = torch.where(ids < mask.num_direct, ids, -1)
    for j, far in enumerate(mask.far_ids.tolist()):
        grammar_ids[far] = mask.num_direct + j
    known = grammar_ids >= 0
    bits = mask.bits.cpu().long() & 0xFFFFFFFF  # the words as unsigned
    words = bits[:, grammar_ids.clamp(min=0) // 32]
    allowed = ((words >> (grammar_ids.clamp(min=0) % 32)) & 1).bool() & known
    free = mask.masked_rows.cpu() == 0
    return (allowed | free[:, None]).to(mask.bits.device)


def sample_tokens_native(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of each row of logits [N, V]: the first index of the max where temperature <= 0,
    else a Gumbel-max draw from softmax(logits / T): argmax_j(logits_j / T + g_j), g = -log(-log(u)).

    The uniforms come from `generator` when given; otherwise row i's come from a generator seeded with
    seeds[i], so that a row's token depends only on its seed and logits (not the same stream as the
    kernel's Philox). Returns token_ids int64 [N] and nan_rows bool [N] (rows holding a NaN). With a
    `mask` (sampling.TokenBitmask), the ids it does not allow are -inf first.
    """
    x = logits.float()
    if mask is not None:
        x = x.masked_fill(~bitmask_allowed(mask, x.shape[1]), float("-inf"))
    nan_rows = x.isnan().any(dim=-1)
    if generator is not None:
        u = torch.rand(x.shape, generator=generator, device=x.device)
    else:
        u = torch.empty_like(x)
        for row, seed in enumerate(seeds.tolist()):
            row_generator = torch.Generator(device=x.device).manual_seed(seed)
            u[row] = torch.rand(x.shape[1], generator=row_generator, device=x.device)
    u = u.clamp(2.0**-32, 1.0 - 2.0**-24)  # strictly inside (0, 1), so the noise is finite
    gumbel = -torch.log(-torch.log(u))
    greedy = temperature <= 0
    safe_temperature = torch.where(greedy, 1.0, temperature.float())
    scores = torch.where(greedy[:, None], x, x / safe_temperature[:, None] + gumbel)
    return scores.argmax(dim=-1), nan_rows
