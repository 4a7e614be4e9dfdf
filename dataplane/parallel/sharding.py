"""Which slice of the model each tensor-parallel rank holds: attention heads, MLP columns, vocabulary.

Attention splits query heads evenly. Grouped KV heads split too where there are at least as many as
ranks; where there are fewer, each rank keeps the one KV head its query heads read (a KV head is then
replicated on tensor_parallel_size / num_kv_heads ranks). The vocabulary is split in equal padded
shards, so any vocabulary size works; padded rows are zeros and their logits are cut off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """What one rank holds of a module's checkpoint tensors.

    dim 0 (column-parallel, vocabulary): output rows; every tensor of the module (weight, bias, scale)
    takes rows `ranges[i]` of its checkpoint part i, whose full size is `full_sizes[i]`. dim 1
    (row-parallel): the weight's input columns `ranges[0]`; bias and per-output-channel scales are whole.
    `rows`: rows of the local tensor when they exceed the range (vocabulary padding, zero-filled).
    """

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_sizes: tuple[int, ...]
    rows: int | None = None


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    first_head: int  # the rank's first query head
    first_kv_head: int


def check_tensor_parallel(
    tensor_parallel_size: int, *, num_heads: int, num_kv_heads: int, intermediate_size: int
) -> None:
    """ValueError naming the setting when the model cannot be split over that many ranks."""
    tp = tensor_parallel_size
    if tp == 1:
        return
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size: {tp} does not divide the model's {num_heads} attention heads; "
            f"use a divisor of {num_heads}"
        )
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp} and the model's {num_kv_heads} KV heads must divide one another "
            "(KV heads are split, or replicated when there are fewer than ranks)"
        )
    if intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size: {tp} does not divide the model's MLP size {intermediate_size}"
        )


def split_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadSplit:
    heads = num_heads // size
    first = rank * heads
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        return HeadSplit(heads, kv, first, rank * kv)
    # Fewer KV heads than ranks: this rank's query heads all read the same KV head.
    return HeadSplit(heads, 1, first, first // (num_heads // num_kv_heads))


def even_range(size: int, rank: int, world: int) -> tuple[int, int]:
    part = size // world
    return rank * part, (rank + 1) * part


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, end, padded rows) of this rank's vocabulary shard; every shard has `padded` rows."""
    padded = -(-vocab_size // world)
    start = min(rank * padded, vocab_size)
    return start, min(start + padded, vocab_size), padded
