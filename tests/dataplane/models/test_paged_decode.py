"""The torch backend's decode path (one query token per sequence, K/V read from the cache)."""

from __future__ import annotations

import random

import pytest
import torch
from modelfleet.dataplane.attention import get_backend
from modelfleet.dataplane.registration import register_builtins
from test_paged_attention import TOLERANCE, make_case, naive_attention


@pytest.fixture(autouse=True, scope="module")
def builtin_backends() -> None:
    register_builtins()  # what loading a model does first


def decode_case(num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int):
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 200) for _ in range(12)]
    return seq_lens, make_case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 32, 8, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (3, 1), (12, 12)], ids=lambda h: "h{}kv{}".format(*h))
def test_decode_batch_of_varied_lengths_matches_naive(heads, window, dtype):
    seq_lens, (q, k, v, kv_cache, meta, tables) = decode_case(*heads, dtype, seed=3)
    backend = get_backend("torch")
    backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    out = backend.forward(q, kv_cache, meta, 0.2, sliding_window=window)
    expected = naive_attention(q, kv_cache, [1] * len(seq_lens), seq_lens, tables, 0.2, window=window)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_later_layers_of_a_step_reuse_the_plan_with_new_queries():
    seq_lens, (q, k, v, kv_cache, meta, tables) = decode_case(6, 2, torch.float32, seed=4)
    backend = get_backend("torch")
    backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    backend.forward(q, kv_cache, meta, 0.2)
    groups = meta.backend_cache["torch_paged"]
    # Another layer: other queries and another cache, same step metadata.
    q2, kv_cache2 = torch.randn_like(q), torch.randn_like(kv_cache)
    out = backend.forward(q2, kv_cache2, meta, 0.2)
    assert meta.backend_cache["torch_paged"] is groups
    expected = naive_attention(q2, kv_cache2, [1] * len(seq_lens), seq_lens, tables, 0.2)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
