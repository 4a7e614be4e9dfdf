"""The embedding split by vocabulary over tensor-parallel ranks: each rank looks up the ids in its shard
(zeros for the others) and an all-reduce sums the ranks' rows into every token's embedding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from modelfleet.dataplane.parallel.sharding import Shard, vocab_range
from torch import nn

if TYPE_CHECKING:
    from modelfleet.dataplane.parallel.group import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, end, padded = vocab_range(vocab_size, tp.rank, tp.size)
        self.num_local = end - self.start
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))
        self.tp_shard = Shard(dim=0, ranges=((self.start, end),), full_sizes=(vocab_size,), rows=padded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0))
