"""Random paged-KV batches for the kernel tests and benchmarks (plain torch, any device)."""

import dataclasses
import math

import torch

# assert_close tolerances of a kernel's output against the float32 reference, by the kernel's dtype
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclasses.dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D], T = sum of query lengths
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], every slot random (unused ones too)
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    max_query_len: int
    max_seq_len: int


def random_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """A batch whose sequences own shuffled, non-adjacent blocks, so a kernel that ignores the block
    table, mixes up sequences or reads past a sequence's end gets visibly wrong answers."""
    if any(q > s for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError("random_paged_batch: a query length exceeds its sequence length")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(max(blocks_per_seq, default=1), 1)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = order[used : used + n]
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(
        q=q.to(device),
        kv_cache=kv_cache.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
