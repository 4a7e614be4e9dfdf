"""AttentionMetadata: what every attention layer of one step needs to find its K/V in the paged cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """One engine step over B sequences and T = sum(query lengths) new tokens.

    Token i of sequence b, at absolute position p, attends to KV positions 0..p of b, read through
    b's block table after this step's K/V are written. Prefill, chunked prefill and decode alike.
    """

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset for each new token's K/V
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [B]: tokens in KV after this step (context + this step's tokens)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    # Tensors a backend derives once per step and reuses in every layer (masks, gather indices).
    backend_cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build from plain lists (tests, simple callers); the new tokens are the last query_len of each."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables need one entry per sequence")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 < q_len <= s_len:
                raise ValueError(f"query_len {q_len} must be in 1..seq_len ({s_len})")
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks is too short for {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(padded), max_blocks
            ),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
