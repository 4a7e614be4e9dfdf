"""The kernel references (tests/dataplane/kernels/reference.py) are the oracles of every GPU kernel test,
so they are checked here, on the CPU, against implementations that share nothing with them: Hugging Face's
LlamaRMSNorm, LlamaRotaryEmbedding and apply_rotary_pos_emb, torch's scaled_dot_product_attention, and a
naive attention that walks the paged cache one position at a time."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from tests.dataplane.kernels import reference as ref

BLOCK = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
# (seq_len, q_len): a whole-prompt prefill, a chunk of a prompt, a decode, a prefill shorter than a block.
SEQS = [(11, 11), (9, 4), (7, 1), (3, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_llama_rms_norm(dtype, with_residual):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64) + 0.5)
    hf = hf.to(dtype)
    x = (torch.randn(5, 64) * 3).to(dtype)
    residual = torch.randn(5, 64).to(dtype) if with_residual else None
    got = ref.rms_norm_native(x, hf.weight.detach(), 1e-5, residual)
    if with_residual:
        got, summed = got
        assert torch.equal(summed, x + residual)
        expected = hf(x + residual)
    else:
        expected = hf(x)
    assert got.dtype == dtype
    assert torch.equal(got, expected.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_hf_llama_rotary(dtype):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=NUM_HEADS * HEAD_DIM * 4, num_attention_heads=NUM_HEADS * 4, num_key_value_heads=2
    )
    head_dim = config.hidden_size // config.num_attention_heads
    hf_rotary = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 2, 5, 17, 1000, 4095])
    q = torch.randn(len(positions), 3, head_dim).to(dtype)
    k = torch.randn(len(positions), 2, head_dim).to(dtype)
    hf_cos, hf_sin = hf_rotary(q, positions[None])  # [1, T, D]: the D/2 angles twice
    cos, sin = ref.rope_cos_sin(hf_rotary.inv_freq, positions, dtype)
    assert cos.shape == (len(positions), head_dim // 2)
    assert torch.equal(torch.cat([cos, cos], -1), hf_cos[0].to(dtype))
    assert torch.equal(torch.cat([sin, sin], -1), hf_sin[0].to(dtype))
    q_out, k_out = ref.rotary_embedding_native(q, k, cos, sin)
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos.to(dtype), hf_sin.to(dtype)
    )
    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))
    # Position 0 is the identity; norms are kept (a rotation) at every position.
    assert torch.equal(q_out[0], q[0])
    if dtype == torch.float32:
        torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))


def paged_case(dtype=torch.float32, seqs=SEQS, num_blocks=24):
    """Random contiguous K/V per sequence, written into a paged cache through shuffled block tables."""
    g = torch.Generator().manual_seed(0)
    max_blocks = max(-(-s // BLOCK) for s, _ in seqs)
    free = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    kv_cache = torch.zeros(2, num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    keys, values, queries, starts = [], [], [], [0]
    for b, (seq_len, q_len) in enumerate(seqs):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK))]
        block_tables[b, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)])
        ref.write_kv_native(k, v, kv_cache, slots)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=g).to(dtype))
        starts.append(starts[-1] + q_len)
    return {
        "q": torch.cat(queries),
        "kv_cache": kv_cache,
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "seq_lens": torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        "block_tables": block_tables,
        "keys": keys,
        "values": values,
    }


def run_reference(case, scale, sliding_window=None):
    return ref.paged_attention_native(
        case["q"],
        case["kv_cache"],
        case["query_start_loc"],
        case["seq_lens"],
        case["block_tables"],
        scale,
        sliding_window=sliding_window,
    )


def sdpa_attention(case, scale, sliding_window=None, see_own_position=True) -> torch.Tensor:
    """torch's scaled_dot_product_attention on each sequence's contiguous K/V (never the paged cache)."""
    out = []
    starts = case["query_start_loc"].tolist()
    group = NUM_HEADS // NUM_KV_HEADS
    for b, seq_len in enumerate(case["seq_lens"].tolist()):
        q = case["q"][starts[b] : starts[b + 1]].float()
        q_len = q.shape[0]
        k = case["keys"][b].float().repeat_interleave(group, dim=1)
        v = case["values"][b].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos if see_own_position else k_pos < q_pos
        if sliding_window:
            allowed &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=allowed,
            scale=scale,
        )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def naive_paged_attention(case, scale, sliding_window=None) -> torch.Tensor:
    """One query, one head, one key at a time, reading the cache through the block table by hand."""
    kv = case["kv_cache"]
    q_all = case["q"]
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    starts = case["query_start_loc"].tolist()
    for b, seq_len in enumerate(case["seq_lens"].tolist()):
        table = case["block_tables"][b].tolist()
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            token = starts[b] + i
            position = seq_len - q_len + i
            first = 0 if not sliding_window else max(0, position - sliding_window + 1)
            for h in range(NUM_HEADS):
                kv_head = h // (NUM_HEADS // NUM_KV_HEADS)
                q = q_all[token, h].double()
                scores, vals = [], []
                for p in range(first, position + 1):
                    block, offset = table[p // BLOCK], p % BLOCK
                    scores.append(float(q @ kv[0, block, offset, kv_head].double()) * scale)
                    vals.append(kv[1, block, offset, kv_head].double())
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                out[token, h] = sum(w / total * v for w, v in zip(weights, vals, strict=True))
    return out


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_paged_attention_is_sdpa_and_a_naive_loop(sliding_window):
    case = paged_case()
    scale = HEAD_DIM**-0.5
    got = run_reference(case, scale, sliding_window)
    assert got.dtype == torch.float32 and got.shape == case["q"].shape
    torch.testing.assert_close(got, sdpa_attention(case, scale, sliding_window), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        got.double(), naive_paged_attention(case, scale, sliding_window), rtol=1e-5, atol=1e-5
    )


def test_paged_attention_in_bf16_rounds_once_at_the_end():
    case = paged_case(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    got = run_reference(case, scale)
    assert got.dtype == torch.bfloat16
    # Computed in float32 from the bf16 inputs, then rounded once: equal to float32 SDPA, rounded.
    expected = sdpa_attention(case, scale).to(torch.bfloat16)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)
    assert (got.float() - expected.float()).abs().max() <= 2 * 2**-8 * expected.float().abs().max()


def test_the_oracles_tell_a_wrong_mask_apart():
    """Their agreement above means something: an attention that hides each query's own position, or that
    ignores the sliding window, is far from the reference."""
    case = paged_case(seqs=[(11, 11), (9, 4), (7, 2)])
    scale = HEAD_DIM**-0.5
    got = run_reference(case, scale)
    assert not torch.allclose(got, sdpa_attention(case, scale, see_own_position=False), atol=1e-2)
    assert not torch.allclose(got, sdpa_attention(case, scale, sliding_window=3), atol=1e-2)
    assert not torch.allclose(got.double(), naive_paged_attention(case, scale, sliding_window=3), atol=1e-2)


def test_write_then_gather_round_trips_and_skips_padding():
    case = paged_case()
    for b, seq_len in enumerate(case["seq_lens"].tolist()):
        k, v = ref.gather_kv_native(case["kv_cache"], case["block_tables"][b], seq_len)
        assert torch.equal(k, case["keys"][b]) and torch.equal(v, case["values"][b])
    cache = torch.zeros(2, 2, BLOCK, 1, 2)
    k = torch.ones(3, 1, 2)
    ref.write_kv_native(k, 2 * k, cache, torch.tensor([5, -1, 0]))
    assert cache[0].view(-1, 2)[[0, 5]].eq(1).all() and cache[1].view(-1, 2)[[0, 5]].eq(2).all()
    assert cache.count_nonzero() == 2 * 2 * 2  # the padded token wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_is_the_llama_mlp_activation(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 2 * 16).to(dtype)
    gate, up = x[:, :16], x[:, 16:]
    expected = transformers.activations.ACT2FN["silu"](gate) * up
    assert torch.equal(ref.silu_and_mul_native(x), expected)


def test_sampling_draws_from_the_softmax_and_greedy_takes_the_first_max():
    logits = torch.tensor([[1.0, 2.0, 0.5, 2.0, -1.0]])
    temperature = 0.8
    rows = 40_000
    g = torch.Generator().manual_seed(0)
    tokens, nan_rows = ref.sample_tokens_native(
        logits.expand(rows, -1), torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.int64), g
    )
    assert not nan_rows.any()
    counts = torch.bincount(tokens, minlength=5).double() / rows
    probs = torch.softmax(logits[0].double() / temperature, -1)
    # 40k draws: each frequency within ~4.5 standard errors of its probability.
    assert (counts - probs).abs().max() < 0.011, (counts, probs)
    greedy, _ = ref.sample_tokens_native(logits, torch.zeros(1), torch.zeros(1, dtype=torch.int64))
    assert greedy.tolist() == [1]  # the first of the two maxima
    # Seeded rows: a row's token depends only on its seed and logits.
    seeds = torch.tensor([7, 8, 7])
    three, _ = ref.sample_tokens_native(logits.expand(3, -1), torch.ones(3), seeds)
    assert three[0] == three[2]
    with_nan = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]])
    _, nan_rows = ref.sample_tokens_native(with_nan, torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    assert nan_rows.tolist() == [True, False]
