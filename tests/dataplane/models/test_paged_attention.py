"""The torch paged-attention backend against a naive per-sequence attention over random data."""

from __future__ import annotations

import random

import pytest
import torch
from modelfleet.dataplane.attention import AttentionMetadata, available_backends, get_backend
from modelfleet.dataplane.registration import register_builtins

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True, scope="module")
def builtin_backends() -> None:
    register_builtins()  # what loading a model does first


def naive_attention(q, kv_cache, query_lens, seq_lens, tables, scale, window=None) -> torch.Tensor:
    """Per sequence, per token: read K/V slot by slot through the block table, softmax in float64."""
    block_size = kv_cache.shape[2]
    group = q.shape[1] // kv_cache.shape[3]
    out, start = [], 0
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        slots = [(table[p // block_size], p % block_size) for p in range(seq_len)]
        k = torch.stack([kv_cache[0, blk, off] for blk, off in slots]).double()
        v = torch.stack([kv_cache[1, blk, off] for blk, off in slots]).double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", q[start + i].double(), k[lo : pos + 1]) * scale
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : pos + 1]))
        start += q_len
    return torch.stack(out).to(q.dtype)


def make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(ids[used : used + n])
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    meta = AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=block_size
    )
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    return q, k, v, kv_cache, meta, tables


SCENARIOS = {
    "prefill_one": ([17], [17]),
    "prefill_batch": ([5, 1, 12], [5, 1, 12]),
    "chunked_with_context": ([6, 3], [20, 3]),
    "decode_batch": ([1, 1, 1, 1], [1, 9, 16, 33]),
    "mixed": ([7, 1, 4], [7, 30, 11]),
}
SHAPES = [(4, 4, 16, 4), (8, 2, 32, 16), (6, 1, 8, 8)]  # (Hq, Hkv, D, block_size): MHA, GQA, MQA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_matches_naive(scenario, shape, dtype):
    query_lens, seq_lens = SCENARIOS[scenario]
    num_heads, num_kv_heads, head_dim, block_size = shape
    q, k, v, kv_cache, meta, tables = make_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    backend = get_backend("torch")
    backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    scale = head_dim**-0.5
    out = backend.forward(q, kv_cache, meta, scale, key=k, value=v)
    expected = naive_attention(q, kv_cache, query_lens, seq_lens, tables, scale)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    # Without the key/value hint every path reads the cache; same answer.
    out_from_cache = get_backend("torch").forward(q, kv_cache, meta, scale)
    torch.testing.assert_close(out_from_cache, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("scenario", ["prefill_one", "prefill_batch", "chunked_with_context", "decode_batch"])
def test_sliding_window(scenario):
    query_lens, seq_lens = SCENARIOS[scenario]
    q, k, v, kv_cache, meta, tables = make_case(query_lens, seq_lens, 4, 2, 16, 4, torch.float32, seed=1)
    backend = get_backend("torch")
    backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    out = backend.forward(q, kv_cache, meta, 0.25, key=k, value=v, sliding_window=5)
    expected = naive_attention(q, kv_cache, query_lens, seq_lens, tables, 0.25, window=5)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_write_kv_puts_each_token_in_its_slot_and_skips_padding():
    kv_cache = torch.zeros(2, 4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    value = -key
    slots = torch.tensor([5, -1, 0])
    get_backend("torch").write_kv(key, value, kv_cache, slots)
    flat_k = kv_cache[0].view(-1, 1, 3)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[0], key[2])
    assert torch.equal(kv_cache[1].view(-1, 1, 3)[0], value[2])
    assert int((flat_k != 0).any(-1).sum()) == 2  # the padding token wrote nothing


def test_metadata_build_computes_slots_through_block_tables():
    meta = AttentionMetadata.build(
        query_lens=[2, 1], seq_lens=[5, 1], block_tables=[[7, 3], [2]], block_size=4
    )
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 3 * 4 + 0, 2 * 4 + 0]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[7, 3], [2, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (2, 5)
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build(query_lens=[1], seq_lens=[9], block_tables=[[0, 1]], block_size=4)


def test_unknown_backend_lists_available():
    assert "torch" in available_backends()
    with pytest.raises(ValueError, match=r"available: .*torch"):
        get_backend("no-such-backend")


def test_large_mixed_batch_is_split_into_groups_and_matches():
    rng = random.Random(7)
    query_lens, seq_lens = [], []
    for _ in range(24):
        kind = rng.choice(["decode", "fresh", "chunk"])
        seq_len = rng.randint(1, 70)
        q_len = 1 if kind == "decode" else seq_len if kind == "fresh" else rng.randint(1, seq_len)
        query_lens.append(q_len)
        seq_lens.append(seq_len)
    q, k, v, kv_cache, meta, tables = make_case(query_lens, seq_lens, 6, 2, 16, 8, torch.float32, seed=7)
    backend = get_backend("torch")
    backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    out = backend.forward(q, kv_cache, meta, 0.3, key=k, value=v)
    groups = meta.backend_cache["torch_paged"]
    assert len(groups) > 2  # decodes, fresh prompts and chunks apart, long and short apart
    assert sorted(torch.cat([g.token_index for g in groups]).tolist()) == list(range(sum(query_lens)))
    torch.testing.assert_close(
        out, naive_attention(q, kv_cache, query_lens, seq_lens, tables, 0.3), atol=2e-5, rtol=1e-5
    )
    # A second layer of the same step reuses the plan.
    backend.forward(q, kv_cache, meta, 0.3, key=k, value=v)
    assert meta.backend_cache["torch_paged"] is groups
