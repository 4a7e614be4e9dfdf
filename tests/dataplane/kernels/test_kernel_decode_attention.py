import random

import pytest
import torch

from tests.dataplane.kernels.paged_batches import TOLERANCES, random_paged_batch
from tests.dataplane.kernels.reference import paged_attention_native

pytestmark = pytest.mark.gpu

HEADS = [(8, 8), (32, 8), (12, 2), (16, 1)]  # (query heads, KV heads): MHA, GQA 4, GQA 6, MQA


def run_decode(batch, scale, **kwargs):
    from modelfleet.dataplane.kernels.decode_attention import decode_attention

    out = torch.full_like(batch.q, float("nan"))  # poisoned: every element must be written
    decode_attention(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        out=out,
        **kwargs,
    )
    return out


def expected(batch, scale):
    return paged_attention_native(
        batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("context", ["short", "long"])
def test_decode_matches_reference(device, dtype, num_heads, num_kv_heads, head_dim, context):
    rng = random.Random(f"{num_heads}-{head_dim}-{context}")
    if context == "long":  # > 4k tokens: several KV splits per sequence
        seq_lens = [rng.randint(4097, 9000) for _ in range(3)]
    else:
        seq_lens = [rng.randint(1, 300) for _ in range(7)] + [1, 16, 17]
    batch = random_paged_batch(
        seq_lens,
        [1] * len(seq_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16 if head_dim == 128 else 32,
        dtype=dtype,
        device=device,
    )
    scale = head_dim**-0.5
    torch.testing.assert_close(run_decode(batch, scale), expected(batch, scale), **TOLERANCES[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3, 8, 64])
def test_decode_any_split_count_gives_the_same_answer(device, block_size, num_splits):
    """More splits than a sequence has tiles leaves empty splits: the merge must ignore them."""
    batch = random_paged_batch(
        [5, 700, 2100, 64],
        [1] * 4,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=device,
    )
    out = run_decode(batch, 0.088, num_splits=num_splits)
    torch.testing.assert_close(out, expected(batch, 0.088), **TOLERANCES[torch.bfloat16])


def test_decode_padding_sequences_output_zeros(device):
    """A CUDA graph runs a batch padded to its captured size: padded rows have seq_len 0."""
    batch = random_paged_batch(
        [300, 0, 0],
        [1, 0, 0],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    q = torch.randn(3, 8, 64, device=device, dtype=torch.float16)
    batch.q = q
    batch.query_start_loc = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=device)
    for num_splits in (1, 4):
        out = run_decode(batch, 0.125, num_splits=num_splits)
        assert torch.equal(out[1:], torch.zeros_like(out[1:]))
        want = paged_attention_native(
            q[:1],
            batch.kv_cache,
            batch.query_start_loc[:2],
            batch.seq_lens[:1],
            batch.block_tables[:1],
            0.125,
        )
        torch.testing.assert_close(out[:1], want, **TOLERANCES[torch.float16])


def test_decode_rejects_head_counts_that_do_not_group(device):
    from modelfleet.dataplane.kernels.decode_attention import decode_attention

    batch = random_paged_batch(
        [10], [1], num_heads=6, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(
            batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 1.0
        )


@pytest.mark.parametrize("window", [1, 100, 5000])
def test_decode_sliding_window(device, window):
    batch = random_paged_batch(
        [3, 250, 4500],
        [1] * 3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    out = run_decode(batch, 0.125, sliding_window=window, num_splits=4)
    want = paged_attention_native(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        0.125,
        sliding_window=window,
    )
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float16])
