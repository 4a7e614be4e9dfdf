"""Speculative decoding: proposers, exact verification, rejection sampling, KV rollback, and the engine's
greedy tokens equal to plain decoding's through preemption, prefix caching and chunked prefill."""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.block_manager import BlockManager
from modelfleet.dataplane.engine.scheduler import Scheduler
from modelfleet.dataplane.engine.sequence import Sequence
from modelfleet.dataplane.engine.speculative import NgramProposer, verify, verify_graph_runner

from .hf_checkpoints import make_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama3.2-tied")


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Another random model of the same vocabulary: a draft that rarely agrees with the target."""
    return make_checkpoint(tmp_path_factory.mktemp("spec-draft") / "llama", "llama2", seed=1)


def tight_llm(model_dir, **kwargs) -> LLM:
    """16 blocks of 16 tokens for requests that need more together: preemption; a 24-token budget:
    prompts are prefilled in chunks; prefix caching on (the default)."""
    return LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=256,
        kv_cache_bytes=16 * 8192,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        **kwargs,
    )


def mixed_prompts() -> list[list[int]]:
    loop = [11, 12, 13, 14, 15, 16, 17]
    shared = list(range(100, 140))  # a shared 40-token prefix: prefix-cache hits
    return [
        loop * 6,
        [*shared, 1, 2, 3],
        [*shared, 4, 5],
        [7, 8, 9],
        [30, 31, 30, 31, 30, 31, 30, 31, 30],
        list(range(200, 237)),
    ]


def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert proposer.propose([5, 6, 7, 5], 2) == [6, 7]  # a 1-gram when no longer one matches
    assert proposer.propose([1, 2, 3], 4) == []
    # A loop shorter than k is read on into the drafts: the loop continued.
    assert proposer.propose([4, 4], 3) == [4, 4, 4]
    assert proposer.propose([9, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_greedy_verify_keeps_the_drafts_up_to_the_first_disagreement():
    vocab = 8
    # Target argmax per row: 3, 5, 6 for the first sequence; 2 for the second (no draft).
    logits = torch.full((4, vocab), -1.0)
    for row, token in enumerate([3, 5, 6, 2]):
        logits[row, token] = 4.0
    generator = torch.Generator().manual_seed(0)
    new = verify(logits, [[3, 4], []], [None, None], [0.0, 0.0], generator)
    assert new == [[3, 5], [2]]
    new = verify(logits[:3], [[3, 5]], [None], [0.0], generator)
    assert new == [[3, 5, 6]]  # all accepted, then the target's token after the last draft


@pytest.mark.parametrize("draft_kind", ["one-hot", "model"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    """The first new token of many verifications of one draft each: a chi-square test against the
    target's p (it fails if acceptance or the residual is off: e.g. keeping every draft gives q)."""
    torch.manual_seed(0)
    vocab, n = 6, 40000
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    q = torch.softmax(torch.tensor([0.0, 2.0, 1.0, 1.0, 0.5, -1.0]), dim=0)
    generator = torch.Generator().manual_seed(1)
    draws = torch.multinomial(q, n, replacement=True, generator=generator).tolist()
    if draft_kind == "one-hot":
        draws = [1 if i % 2 else 4 for i in range(n)]  # a deterministic draft, whatever it is
        probs = [None] * n
    else:
        probs = [q.unsqueeze(0)] * n
    logits = p_logits.repeat(2 * n, 1)  # two rows per sequence: its draft's and the bonus
    new = verify(logits, [[d] for d in draws], probs, [1.0] * n, generator)
    counts = torch.bincount(torch.tensor([t[0] for t in new]), minlength=vocab).double()
    expected = torch.softmax(p_logits, dim=0).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    # Acceptance is as often as min(p, q) says: sum_x min(p(x), q(x)).
    p = torch.softmax(p_logits, dim=0)
    expected_rate = (p[1] + p[4]) / 2 if draft_kind == "one-hot" else torch.minimum(p, q).sum()
    accepted = sum(len(t) == 2 for t in new) / n
    assert accepted == pytest.approx(float(expected_rate), abs=0.01)


def test_each_position_of_several_drafts_follows_its_own_row():
    """Two drafts, three rows with different p: the first token follows p0, the second (given the first
    draft was kept) p1, the third (given both) p2; a row off by one would give another row's p."""
    n = 60000
    rows = torch.tensor([[1.5, 0.0, 0.5, -0.5], [0.0, 1.0, -1.0, 0.5], [-1.0, 0.0, 1.0, 0.3]])
    generator = torch.Generator().manual_seed(4)
    new = verify(rows.repeat(n, 1), [[0, 1]] * n, [None] * n, [1.0] * n, generator)
    p = torch.softmax(rows, dim=-1).double()
    samples = [
        [t[0] for t in new],
        [t[1] for t in new if len(t) > 1],  # the first draft (0) was kept
        [t[2] for t in new if len(t) > 2],  # both were
    ]
    for position, tokens in enumerate(samples):
        counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
        expected = p[position] * len(tokens)
        assert float(((counts - expected) ** 2 / expected).sum()) < 16.3  # 3 degrees of freedom: p = 0.001


def test_temperature_scales_the_target_in_verification():
    """At temperature 0.5 the target is p ∝ exp(2 logits): the first tokens follow that, not exp(logits)."""
    n = 30000
    p_logits = torch.tensor([1.0, 0.0, 0.5])
    generator = torch.Generator().manual_seed(2)
    new = verify(p_logits.repeat(2 * n, 1), [[1]] * n, [None] * n, [0.5] * n, generator)
    counts = torch.bincount(torch.tensor([t[0] for t in new]), minlength=3).double()
    expected = torch.softmax(p_logits / 0.5, dim=0).double() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 13.8  # 2 degrees of freedom: p = 0.001


def test_a_verify_step_gives_back_the_slots_of_rejected_drafts():
    block_manager = BlockManager(8, 4)
    sched = Scheduler(
        block_manager, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, num_speculative_tokens=4
    )
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20, **GREEDY))
    sched.add(seq)
    sched.update(sched.schedule(), [4])  # prefill: 4 tokens, one block
    step = sched.schedule()
    (item,) = step.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.num_lookahead) == (3, 1, 4)
    assert len(seq.block_ids) == 2  # slots up to position 7: the last token and four drafts
    sched.update(step, [[5, 9]])  # one draft accepted (5), the target's own token after it (9)
    assert seq.token_ids == [1, 2, 3, 4, 5, 9] and seq.num_computed_tokens == 5
    assert len(seq.block_ids) == 2 and block_manager.num_free_blocks == 6
    step = sched.schedule()
    sched.update(step, [[7]])  # every draft rejected
    assert seq.num_computed_tokens == 6 and len(seq.block_ids) == 2
    # No block holding a draft was named for the prefix cache: only the first, of known tokens.
    assert [block_manager.blocks[b].block_hash is not None for b in seq.block_ids] == [True, False]


def test_drafts_stop_at_max_tokens_and_at_a_stop_token():
    sched = Scheduler(
        BlockManager(8, 4),
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len=64,
        num_speculative_tokens=4,
    )
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=3, stop_token_ids=[8], temperature=0.0))
    sched.add(seq)
    sched.update(sched.schedule(), [4])
    step = sched.schedule()
    assert step.scheduled[0].num_lookahead == 1  # two tokens left: one draft and the target's own
    sched.update(step, [[8, 5]])
    assert seq.output_token_ids == [4, 8] and seq.finish_reason == "stop"
    assert sched.block_manager.num_free_blocks == 8


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-other"])
def test_greedy_tokens_equal_plain_decoding(model_dir, other_model_dir, proposer):
    params = [SamplingParams(max_tokens=28 + 3 * i, **GREEDY) for i in range(6)]
    plain = tight_llm(model_dir)
    expected = [o.token_ids for o in plain.generate(mixed_prompts(), params)]
    kwargs: dict = dict(speculative_proposer="ngram", num_speculative_tokens=3)
    if proposer != "ngram":
        draft = model_dir if proposer == "draft-self" else other_model_dir
        kwargs = dict(
            speculative_proposer="draft", speculative_draft_model=str(draft), num_speculative_tokens=3
        )
    spec = tight_llm(model_dir, **kwargs)
    got = [o.token_ids for o in spec.generate(mixed_prompts(), params)]
    assert got == expected
    # Again with the prefix cache warm: hits on blocks a speculating engine filled.
    assert [o.token_ids for o in spec.generate(mixed_prompts(), params)] == expected
    stats = spec.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_mean_accepted_length == pytest.approx(
        1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    )
    if proposer == "draft-self":  # the target as its own draft agrees with itself
        assert stats.spec_acceptance_rate > 0.95
    elif proposer == "ngram":  # the loop prompts repeat
        assert stats.spec_acceptance_rate > 0.3
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_verify_steps_in_the_graph_layout_give_plain_tokens(model_dir, proposer):
    """The CUDA graphs' layout, run eagerly here: every sequence padded to k + 1 rows (padding rows
    write no KV), the batch padded to a captured size on the GPU."""
    params = [SamplingParams(max_tokens=28 + 3 * i, **GREEDY) for i in range(6)]
    expected = [o.token_ids for o in tight_llm(model_dir).generate(mixed_prompts(), params)]
    extra: dict = dict(speculative_proposer="ngram")
    if proposer == "draft-self":
        extra = dict(speculative_proposer="draft", speculative_draft_model=str(model_dir))
    spec = tight_llm(model_dir, num_speculative_tokens=3, **extra)
    runner, speculator = spec.engine.runner, spec.engine.speculator
    graphs = verify_graph_runner(
        runner.model, runner.kv_caches, max_batch_size=6, num_tokens_per_seq=4, max_blocks_per_seq=16
    )
    assert not graphs.enabled  # no CUDA: the same forward, eagerly
    calls = []
    run = graphs.run
    graphs.run = lambda inputs, batch_size: calls.append(batch_size) or run(inputs, batch_size)
    speculator.graphs = graphs
    draft_calls = []
    if proposer == "draft-self":  # the draft's one-token forwards through its decode graphs' runner
        from modelfleet.dataplane.kernels.cuda_graphs import model_decode_runner

        draft = speculator.proposer
        draft.graphs = model_decode_runner(
            draft.model, draft.kv_caches, max_batch_size=6, max_blocks_per_seq=16, enabled=False
        )
        draft_run = draft.graphs.run
        draft.graphs.run = lambda inputs, batch_size: (
            draft_calls.append(batch_size) or draft_run(inputs, batch_size)
        )
    assert [o.token_ids for o in spec.generate(mixed_prompts(), params)] == expected
    assert len(calls) > 10 and spec.stats().spec_num_accepted_tokens > 0
    assert (len(draft_calls) > 10) == (proposer == "draft-self")
    if proposer == "draft-self":  # the draft's KV, written through that runner, is right
        assert spec.stats().spec_acceptance_rate > 0.95


def test_sampled_and_plain_requests_share_verify_steps(model_dir):
    spec = tight_llm(model_dir, speculative_proposer="ngram", num_speculative_tokens=4)
    prompts = mixed_prompts()
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),  # plain: has a seed
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),  # plain: logprobs
        SamplingParams(max_tokens=20, temperature=1.0, top_k=5, ignore_eos=True),  # plain: a filter
    ]
    outputs = spec.generate(prompts[:4], params)
    assert [len(o.token_ids) for o in outputs] == [20] * 4
    assert all(0 <= t < 512 for o in outputs for t in o.token_ids)
    assert outputs[2].logprobs is not None and len(outputs[2].logprobs) == 20
    # The seeded request is not speculated: its tokens are those of a plain engine with the same seed.
    alone = tight_llm(model_dir).generate(prompts[1], params[1])[0].token_ids
    assert outputs[1].token_ids == alone


def test_settings_are_checked(model_dir):
    with pytest.raises(ValueError, match="speculative_proposer"):
        EngineConfig(str(model_dir), speculative_proposer="medusa")
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(str(model_dir), speculative_proposer="draft")
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(str(model_dir), speculative_draft_model=str(model_dir))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(str(model_dir), speculative_proposer="ngram", num_speculative_tokens=0)
    assert EngineConfig(str(model_dir)).speculative_proposer == "none"  # off by default


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_tokens_equal_plain_decoding_with_the_host_kv_tier(model_dir, proposer):
    """Blocks evicted to host memory and copied back: the target's KV only (a draft's keys and values
    of those blocks are stale, which may cost acceptance, never tokens)."""
    params = [SamplingParams(max_tokens=28 + 3 * i, **GREEDY) for i in range(6)]
    expected = [o.token_ids for o in tight_llm(model_dir).generate(mixed_prompts(), params)]
    extra: dict = dict(speculative_proposer=proposer, num_speculative_tokens=3)
    if proposer == "draft":
        extra["speculative_draft_model"] = str(model_dir)
    spec = tight_llm(model_dir, host_kv_cache_bytes=1 << 20, **extra)
    for _ in range(2):
        assert [o.token_ids for o in spec.generate(mixed_prompts(), params)] == expected
    stats = spec.stats()
    assert stats.host_kv_hits > 0 and stats.spec_num_accepted_tokens > 0
