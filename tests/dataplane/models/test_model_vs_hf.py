"""Our models through the paged KV cache against Hugging Face transformers, in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_checkpoints import ARCHITECTURES, make_checkpoint
from modelfleet.dataplane.attention import AttentionMetadata
from modelfleet.dataplane.models import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 40
ATOL = 2e-4  # float32; logits are O(1..5) with these weights


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def pair(request, tmp_path_factory):
    """(our model, HF model) for one architecture, same weights."""
    model_dir, hf_model = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    ours = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    return ours, hf_model


def new_kv_caches(model) -> list[torch.Tensor]:
    cfg = model.config
    shape = (cfg.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return list(torch.zeros(shape).unbind(0))  # per-layer views of one allocation, as the engine does


def hf_logits(hf_model, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(token_ids[None]).logits[0].float()


def run_step(model, kv_caches, seqs: list[tuple[torch.Tensor, int, int, list[int]]]) -> list[torch.Tensor]:
    """One engine step. seqs: (all tokens so far, num cached, num new, block table) -> logits per seq."""
    ids, positions = [], []
    for tokens, cached, new, _ in seqs:
        ids.append(tokens[cached : cached + new])
        positions.append(torch.arange(cached, cached + new))
    meta = AttentionMetadata.build(
        query_lens=[new for _, _, new, _ in seqs],
        seq_lens=[cached + new for _, cached, new, _ in seqs],
        block_tables=[table for *_, table in seqs],
        block_size=BLOCK_SIZE,
    )
    with torch.inference_mode():
        hidden = model(torch.cat(ids), torch.cat(positions), kv_caches, meta)
        logits = model.compute_logits(hidden)
    return list(logits.split([new for _, _, new, _ in seqs]))


def test_config_matches_hf(pair):
    ours, hf_model = pair
    hf_cfg = hf_model.config
    assert ours.config.num_layers == hf_cfg.num_hidden_layers
    assert ours.config.num_kv_heads == hf_cfg.num_key_value_heads
    assert ours.config.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert ours.config.eos_token_ids == (2,)


def test_full_prompt_logits(pair):
    ours, hf_model = pair
    tokens = torch.randint(0, ours.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    table = [17, 3, 9, 0, 31, 12]  # scattered blocks, including block 0
    (logits,) = run_step(ours, new_kv_caches(ours), [(tokens, 0, len(tokens), table)])
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_step_by_step(pair):
    ours, hf_model = pair
    tokens = torch.randint(0, ours.config.vocab_size, (26,), generator=torch.Generator().manual_seed(2))
    expected = hf_logits(hf_model, tokens)
    table = [5, 2, 30, 11, 7, 19, 25]
    kv = new_kv_caches(ours)
    got = []
    for start, length in [(0, 9), (9, 7)]:  # prefill in two chunks, the second over cached context
        got.extend(run_step(ours, kv, [(tokens, start, length, table)]))
    for pos in range(16, len(tokens)):  # then one token per step
        got.extend(run_step(ours, kv, [(tokens, pos, 1, table)]))
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_mixed_batch_of_prefill_chunk_decode_and_new_prompt(pair):
    ours, hf_model = pair
    gen = torch.Generator().manual_seed(3)
    vocab = ours.config.vocab_size
    a, b, c = (torch.randint(0, vocab, (n,), generator=gen) for n in (14, 11, 6))
    tables = {"a": [1, 2, 3, 4], "b": [10, 8, 6], "c": [20, 21]}
    kv = new_kv_caches(ours)
    # step 1: a's first 5 tokens, all of b but its last token
    run_step(ours, kv, [(a, 0, 5, tables["a"]), (b, 0, 10, tables["b"])])
    # step 2: a's next chunk (cached context), b decodes its last token, c arrives whole
    out_a, out_b, out_c = run_step(
        ours, kv, [(a, 5, 9, tables["a"]), (b, 10, 1, tables["b"]), (c, 0, 6, tables["c"])]
    )
    torch.testing.assert_close(out_a, hf_logits(hf_model, a)[5:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b, hf_logits(hf_model, b)[10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_c, hf_logits(hf_model, c), atol=ATOL, rtol=0)


def test_batched_decode(pair):
    ours, hf_model = pair
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=gen) for n in (3, 9, 1, 12)]
    tables = [[4 * i + j for j in range(4)] for i in range(len(prompts))]
    kv = new_kv_caches(ours)
    run_step(ours, kv, [(p, 0, len(p) - 1, t) for p, t in zip(prompts, tables, strict=True) if len(p) > 1])
    outs = run_step(ours, kv, [(p, len(p) - 1, 1, t) for p, t in zip(prompts, tables, strict=True)])
    for prompt, out in zip(prompts, outs, strict=True):
        torch.testing.assert_close(out, hf_logits(hf_model, prompt)[-1:], atol=ATOL, rtol=0)


def test_bfloat16_close_to_hf_bfloat16(tmp_path: Path):
    model_dir, hf_model = make_checkpoint("llama3", tmp_path)
    ours = load_model(model_dir, device="cpu", dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, ours.config.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    kv = [c.to(torch.bfloat16) for c in new_kv_caches(ours)]
    (logits,) = run_step(ours, kv, [(tokens, 0, 12, [0, 1, 2])])
    expected = hf_logits(hf_model.to(torch.bfloat16), tokens)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.05)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
