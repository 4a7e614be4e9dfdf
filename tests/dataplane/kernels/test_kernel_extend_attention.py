import random

import pytest
import torch

from tests.dataplane.kernels.paged_batches import TOLERANCES, random_paged_batch
from tests.dataplane.kernels.reference import paged_attention_native

pytestmark = pytest.mark.gpu


def run_extend(batch, scale):
    from modelfleet.dataplane.kernels.extend_attention import extend_attention

    out = torch.full_like(batch.q, float("nan"))
    extend_attention(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        scale,
        out=out,
    )
    return out


def expected(batch, scale):
    return paged_attention_native(
        batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )


# (seq_lens, query_lens): plain prefill, prefix-cached context, chunked prefill, decode mixed in
WORKLOADS = {
    "prefill": ([1, 17, 130, 64], [1, 17, 130, 64]),
    "cached_prefix": ([200, 96, 513], [8, 33, 1]),
    "mixed": ([77, 1000, 5, 4500], [77, 200, 1, 1]),
    "long_prefill": ([4400], [4400]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (32, 8), (12, 2), (16, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("workload", ["prefill", "cached_prefix", "mixed"])
def test_extend_matches_reference(device, dtype, num_heads, num_kv_heads, head_dim, workload):
    seq_lens, query_lens = WORKLOADS[workload]
    batch = random_paged_batch(
        seq_lens,
        query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16 if head_dim == 64 else 32,
        dtype=dtype,
        device=device,
    )
    scale = head_dim**-0.5
    torch.testing.assert_close(run_extend(batch, scale), expected(batch, scale), **TOLERANCES[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
def test_extend_long_prefill(device, block_size):
    seq_lens, query_lens = WORKLOADS["long_prefill"]
    batch = random_paged_batch(
        seq_lens,
        query_lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=device,
    )
    torch.testing.assert_close(run_extend(batch, 0.09), expected(batch, 0.09), **TOLERANCES[torch.bfloat16])


def test_chunked_prefill_equals_whole_prefill(device):
    """A prompt computed in three chunks (each over the cache the earlier ones filled) gives the same
    outputs as computing it at once."""
    rng = random.Random(1)
    total = 301
    cuts = sorted(rng.sample(range(1, total), 2))
    whole = random_paged_batch(
        [total],
        [total],
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    at_once = run_extend(whole, 0.125)
    pieces = []
    for start, end in zip([0, *cuts], [*cuts, total], strict=True):
        chunk = random_paged_batch(
            [end],
            [end - start],
            num_heads=16,
            num_kv_heads=4,
            head_dim=64,
            block_size=16,
            dtype=torch.float16,
            device=device,
        )
        chunk.kv_cache, chunk.block_tables = whole.kv_cache, whole.block_tables
        chunk.q = whole.q[start:end].contiguous()
        pieces.append(run_extend(chunk, 0.125))
    torch.testing.assert_close(torch.cat(pieces), at_once, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [1, 37, 300])
def test_extend_sliding_window(device, window):
    from modelfleet.dataplane.kernels.extend_attention import extend_attention

    batch = random_paged_batch(
        [200, 96, 513],
        [150, 33, 1],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    args = (batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    out = extend_attention(*args, batch.max_query_len, 0.125, sliding_window=window)
    want = paged_attention_native(*args, 0.125, sliding_window=window)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float16])
