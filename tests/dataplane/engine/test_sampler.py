"""Sampler: greedy, filters, seeded and batch-independent sampling, penalties, logprobs, NaN rows."""

import math

import pytest
import torch
from modelfleet.dataplane.engine.sampler import Sampler, SamplerOutput, apply_penalties
from modelfleet.dataplane.engine.sequence import Sequence
from modelfleet.dataplane.sampling_params import SamplingParams

CPU = torch.device("cpu")


def seq(params: SamplingParams, prompt=(1, 2, 3), output=(), request_id="r") -> Sequence:
    s = Sequence(request_id, list(prompt), params)
    for t in output:
        s.append_token(t)
    return s


def sample(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
    """One step's tokens, waited for."""
    return sampler.sample(logits, seqs).result()


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_per_row():
    logits = random_logits(4)
    out = sample(Sampler(CPU), logits, [seq(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.errors == [None] * 4 and out.logprobs == [None] * 4


@pytest.mark.parametrize(
    "params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k=1", "tiny top_p", "min_p=1"]
)
def test_filters_that_keep_one_token_give_the_argmax(params):
    logits = random_logits(6)
    sampler = Sampler(CPU, seed=3)
    for _ in range(5):
        out = sample(sampler, logits, [seq(SamplingParams(temperature=1.5, **params)) for _ in range(6)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_samples_only_among_the_k_best():
    logits = random_logits(1, seed=1)
    best3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(CPU, seed=0)
    params = SamplingParams(top_k=3, temperature=5.0)
    seen = {sample(sampler, logits, [seq(params)]).token_ids[0] for _ in range(200)}
    assert seen == best3


def test_top_p_keeps_the_smallest_head_reaching_the_mass():
    # Probabilities 0.5, 0.3, 0.2: top_p 0.6 keeps the first two.
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    sampler = Sampler(CPU, seed=0)
    seen = {sample(sampler, logits, [seq(SamplingParams(top_p=0.6))]).token_ids[0] for _ in range(200)}
    assert seen == {1, 2}


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    out = sample(Sampler(CPU, seed=0), logits, [seq(SamplingParams(temperature=1.0)) for _ in range(4000)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3) / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = random_logits(5, seed=7)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch_rows: list[int], target_row: int, sampler_seed: int) -> list[int]:
        target = seq(params, request_id="target")
        sampler = Sampler(CPU, seed=sampler_seed)
        tokens = []
        for _ in range(20):
            seqs = [target if r == target_row else seq(SamplingParams(temperature=1.0)) for r in batch_rows]
            out = sample(sampler, logits[batch_rows], seqs)
            tokens.append(out.token_ids[batch_rows.index(target_row)])
        return tokens

    alone = draw([2], 2, sampler_seed=0)
    in_batch = draw([0, 1, 2, 3, 4], 2, sampler_seed=99)
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_unseeded_sampling_follows_the_engine_seed():
    logits = random_logits(8, seed=2)
    seqs = [seq(SamplingParams(temperature=1.0)) for _ in range(8)]

    def draws(seed: int) -> list[list[int]]:
        sampler = Sampler(CPU, seed=seed)
        return [sample(sampler, logits, seqs).token_ids for _ in range(5)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0]])
    s = seq(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))
    out = apply_penalties(logits, [s])
    assert out.tolist() == [[1.0, -4.0, 1.0, 4.0]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, 4.0]]  # input untouched


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    s = seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(3, 3), output=(1, 1, 2))
    out = apply_penalties(logits, [s])
    assert out.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    out = sample(Sampler(CPU), logits, [seq(params, output=(0,))])
    assert out.token_ids == [1]


def test_logprobs_report_top_n_and_the_chosen_token():
    logits = random_logits(2, seed=4)
    expected = torch.log_softmax(logits, dim=-1)
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=3)), seq(SamplingParams(temperature=0.0))]
    out = sample(Sampler(CPU), logits, seqs)
    top = expected[0].topk(3)
    assert set(out.logprobs[0]) == set(top.indices.tolist())
    for token_id, value in out.logprobs[0].items():
        assert math.isclose(value, expected[0, token_id].item(), rel_tol=1e-6)
    assert out.logprobs[1] is None


def test_logprobs_zero_reports_just_the_chosen_token():
    logits = random_logits(1, seed=5)
    out = sample(Sampler(CPU, seed=1), logits, [seq(SamplingParams(temperature=1.0, logprobs=0))])
    ((token_id, value),) = out.logprobs[0].items()
    assert token_id == out.token_ids[0]
    assert math.isclose(value, torch.log_softmax(logits, -1)[0, token_id].item(), rel_tol=1e-6)


def test_nan_logits_fail_only_their_row():
    logits = random_logits(3, seed=6)
    logits[1, 4] = float("nan")
    out = sample(Sampler(CPU), logits, [seq(SamplingParams(temperature=0.0)) for _ in range(3)])
    assert out.errors[1] is not None and "NaN" in out.errors[1]
    assert out.errors[0] is None and out.errors[2] is None
    assert [out.token_ids[0], out.token_ids[2]] == logits[[0, 2]].argmax(dim=-1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_read_batch_gives_its_pinned_buffer_to_the_next_and_an_unread_one_keeps_its_own():
    """SampledBatch reads a step's tokens back through pinned buffers reused from batch to batch: a
    batch's goes to the next once read, never while unread (its copy may still be in flight)."""
    from modelfleet.dataplane.engine.sampler import SampledBatch

    def batch(rows):
        pairs = torch.tensor(rows, dtype=torch.int64, device="cuda")
        return SampledBatch(pairs, None, [SamplingParams()] * len(rows))

    with torch.inference_mode():  # as the engine makes them; its buffers go to batches made outside too
        first = batch([[1, 0], [2, 0], [3, 0]])
    second = batch([[4, 0], [5, 0], [6, 0]])  # the first is unread: a buffer of its own
    assert second._host[0].data_ptr() != first._host[0].data_ptr()
    assert first.host_token_ids() == [1, 2, 3]
    third = batch([[7, 0], [8, 1]])
    assert third._host[0].data_ptr() == first._host[0].data_ptr()  # the first, read, gave its own
    assert second.host_token_ids() == [4, 5, 6] and first.host_token_ids() == [1, 2, 3]
    assert third.result().token_ids == [7, 8]
    assert third.result().errors == [None, "the model produced NaN logits"]
