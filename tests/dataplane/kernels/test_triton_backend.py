"""The Triton backend against the torch backend, through the AttentionBackend interface."""

import random

import pytest
import torch
from modelfleet.dataplane.attention import AttentionMetadata, get_backend

from tests.dataplane.kernels.paged_batches import TOLERANCES

pytestmark = pytest.mark.gpu


def build_step(query_lens, seq_lens, block_size, num_blocks, device):
    rng = random.Random(7)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(free[:n])
        free = free[n:]
    return AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=block_size, device=device
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1], [40, 700, 5000]), ([50, 1, 20], [50, 300, 90]), ([129], [129])],
    ids=["decode", "mixed", "prefill"],
)
@pytest.mark.parametrize("sliding_window", [None, 64])
def test_triton_backend_matches_torch_backend(device, dtype, query_lens, seq_lens, sliding_window):
    from modelfleet.dataplane.registration import register_builtins

    register_builtins()  # as an engine's start: "triton" and "torch"

    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 16, 4, 64, 16, 400
    meta = build_step(query_lens, seq_lens, block_size, num_blocks, device)
    num_tokens = sum(query_lens)
    triton_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    torch_cache = triton_cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    query = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)

    outs = []
    for name, cache in (("triton", triton_cache), ("torch", torch_cache)):
        backend = get_backend(name)
        backend.write_kv(key, value, cache, meta.slot_mapping)
        outs.append(backend.forward(query, cache, meta, 0.125, sliding_window=sliding_window))
    assert torch.equal(triton_cache, torch_cache)
    torch.testing.assert_close(outs[0], outs[1], **TOLERANCES[dtype])
