"""`validate.compare` on made-up logits: every threshold of every dtype just met and just missed, a flipped
top token, a NaN. Each check is exercised alone, so removing or loosening any one of them fails a case."""

from __future__ import annotations

import math

import pytest
import torch
from modelfleet.converters import validate
from modelfleet.converters.validate import THRESHOLDS, compare

VOCAB = 8
POSITIONS = 25  # per prompt; 4 prompts -> 100 positions, so top-1 agreement moves in steps of 0.01
PROMPTS = [[p * 100 + i for i in range(POSITIONS)] for p in range(4)]
TEXT = [7, 3, 5, 1, 0, 2, 6, 4, 3, 3, 1, 5]
GAP = 1e-6  # between the top two reference logits at every position: a flip costs almost no logit diff
JUST = (0.99, 1.01)  # just under, just over a threshold

# The published table in the module's docstring, so a changed threshold shows up here.
TABLE = {
    "fp32": (0.001, 0.99, 0.001),
    "fp16": (0.05, 0.97, 0.01),
    "bf16": (0.25, 0.90, 0.03),
    "int8": (0.50, 0.85, 0.05),
    "fp8": (1.00, 0.75, 0.10),
}


def ref_logits(ids: list[int]) -> torch.Tensor:
    """Prompts: distinct logits with the top two GAP apart (top at a position-dependent index). The text:
    all zeros, so its perplexity is exactly VOCAB."""
    if ids == TEXT:
        return torch.zeros(len(ids), VOCAB)
    g = torch.Generator().manual_seed(ids[0])
    rows = torch.randn(len(ids), VOCAB, generator=g).clamp(-2.0, 2.0)  # under the top two
    for row, token in zip(rows, ids, strict=True):
        top, second = token % VOCAB, (token + 1) % VOCAB
        row[top] = 3.0
        row[second] = 3.0 - GAP
    return rows


def ref_std() -> float:
    return torch.cat([ref_logits(ids) for ids in PROMPTS]).std().item()


def candidate(*, flips: int = 0, diff: float = 0.0, ppl_ratio: float = 1.0, nan: bool = False):
    """The reference, changed in one way: `flips` positions with the top two swapped; `diff` added to the
    lowest logit of one position; text logits giving perplexity VOCAB * ppl_ratio; a NaN logit."""

    def run(ids: list[int]) -> torch.Tensor:
        logits = ref_logits(ids).clone()
        if ids == TEXT:
            # Target logit a over zeros: ppl = 1 + (V - 1) e^-a; solve for ppl = V * ppl_ratio.
            a = -math.log((VOCAB * ppl_ratio - 1) / (VOCAB - 1))
            logits[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] = a
            return logits
        p = PROMPTS.index(ids)
        for pos in range(len(ids)):
            if p * POSITIONS + pos < flips:
                top, second = ids[pos] % VOCAB, (ids[pos] + 1) % VOCAB
                logits[pos, top], logits[pos, second] = logits[pos, second].item(), logits[pos, top].item()
        if p == 1 and diff:
            low = int(logits[3].argmin())
            logits[3, low] += diff
        if p == 2 and nan:
            logits[5, int(logits[5].argmin())] = float("nan")
        return logits

    return run


def run_compare(dtype: str, **kw) -> dict:
    return compare(ref_logits, candidate(**kw), PROMPTS, TEXT, dtype)


def test_thresholds_are_the_published_table():
    assert {
        k: (t.max_logit_diff_std, t.min_top1_agreement, t.max_perplexity_rel_diff)
        for k, t in THRESHOLDS.items()
    } == TABLE
    for dtype, values in TABLE.items():
        assert f"| {dtype} " in validate.__doc__ and all(f"{v:.3g}" in validate.__doc__ for v in values)


def test_identical_logits_pass_every_dtype():
    for dtype in TABLE:
        result = run_compare(dtype)
        assert result["passed"] and result["failures"] == []
        assert (result["maxAbsLogitDiff"], result["top1Agreement"], result["perplexityRelDiff"]) == (0, 1, 0)
        assert result["numPositions"] == 4 * POSITIONS
        assert result["perplexityRef"] == pytest.approx(VOCAB)


@pytest.mark.parametrize("dtype", TABLE)
@pytest.mark.parametrize("factor", JUST)
def test_max_logit_diff_threshold(dtype, factor):
    allowed = TABLE[dtype][0] * ref_std()
    result = run_compare(dtype, diff=allowed * factor)
    assert result["maxAbsLogitDiff"] == pytest.approx(allowed * factor, rel=1e-4)
    assert result["thresholds"]["maxAbsLogitDiff"] == pytest.approx(allowed, rel=1e-4)
    assert result["top1Agreement"] == 1 and result["perplexityRelDiff"] == 0
    if factor < 1:
        assert result["passed"] and result["failures"] == []
    else:
        assert not result["passed"]
        assert len(result["failures"]) == 1 and result["failures"][0].startswith("max |logit diff|")


@pytest.mark.parametrize("dtype", TABLE)
@pytest.mark.parametrize("extra", [0, 1])
def test_top1_agreement_threshold(dtype, extra):
    """At exactly the minimum agreement it passes; one more flipped position fails."""
    min_agree = TABLE[dtype][1]
    flips = round((1 - min_agree) * 4 * POSITIONS) + extra
    result = run_compare(dtype, flips=flips)
    assert result["top1Agreement"] == pytest.approx(1 - flips / (4 * POSITIONS))
    assert result["maxAbsLogitDiff"] <= 2 * GAP  # a flip alone stays far under every logit threshold
    if extra == 0:
        assert result["passed"] and result["failures"] == []
    else:
        assert not result["passed"]
        assert len(result["failures"]) == 1 and result["failures"][0].startswith("top-1 agreement")


@pytest.mark.parametrize("dtype", TABLE)
@pytest.mark.parametrize("factor", JUST)
@pytest.mark.parametrize("sign", [1, -1])
def test_perplexity_threshold(dtype, factor, sign):
    rel = TABLE[dtype][2] * factor
    result = run_compare(dtype, ppl_ratio=1 + sign * rel)
    assert result["perplexityRelDiff"] == pytest.approx(rel, rel=1e-3)
    assert result["maxAbsLogitDiff"] == 0 and result["top1Agreement"] == 1
    if factor < 1:
        assert result["passed"] and result["failures"] == []
    else:
        assert not result["passed"]
        assert len(result["failures"]) == 1 and result["failures"][0].startswith("perplexity diff")


@pytest.mark.parametrize("dtype", TABLE)
def test_a_nan_logit_fails_as_an_infinite_difference(dtype):
    # One NaN at a position's lowest logit leaves its top-1 alone (99 or 100 of 100 agree), so only the
    # NaN guard can fail it: NaN compares false with everything and would slip through max().
    result = run_compare(dtype, nan=True)
    assert not result["passed"]
    assert result["maxAbsLogitDiff"] == "inf"
    assert any(f.startswith("max |logit diff| inf") for f in result["failures"])


def test_a_non_finite_text_perplexity_fails():
    def cand(ids: list[int]) -> torch.Tensor:
        logits = ref_logits(ids)
        return torch.full_like(logits, float("nan")) if ids == TEXT else logits

    result = compare(ref_logits, cand, PROMPTS, TEXT, "fp8")
    assert not result["passed"]
    assert result["perplexityRelDiff"] == "inf"
    assert result["failures"] == [f"perplexity diff inf > {TABLE['fp8'][2]}"]


def test_a_difference_exactly_at_a_threshold_passes(monkeypatch):
    """The logit and perplexity limits are inclusive: thresholds set to exactly the measured values pass,
    and the next float below them fails."""
    cand = candidate(diff=0.3)
    diff = max((ref_logits(ids) - cand(ids)).abs().max().item() for ids in PROMPTS)
    logit_std = diff / ref_std()
    while logit_std * ref_std() < diff:  # the product must come back to the diff exactly
        logit_std = math.nextafter(logit_std, math.inf)
    assert logit_std * ref_std() == diff  # what compare() will weigh: max_diff <= std * threshold
    monkeypatch.setitem(THRESHOLDS, "fp8", validate.Thresholds(logit_std, 0.75, 0.10))
    result = compare(ref_logits, cand, PROMPTS, TEXT, "fp8")
    assert result["passed"], result["failures"]
    monkeypatch.setitem(THRESHOLDS, "fp8", validate.Thresholds(logit_std * (1 - 1e-9), 0.75, 0.10))
    assert not compare(ref_logits, cand, PROMPTS, TEXT, "fp8")["passed"]

    cand = candidate(ppl_ratio=1.02)
    ppl_ref = validate.perplexity(ref_logits(TEXT), TEXT)
    rel = abs(validate.perplexity(cand(TEXT), TEXT) - ppl_ref) / ppl_ref
    monkeypatch.setitem(THRESHOLDS, "fp8", validate.Thresholds(1.0, 0.75, rel))
    result = compare(ref_logits, cand, PROMPTS, TEXT, "fp8")
    assert result["passed"], result["failures"]
    monkeypatch.setitem(THRESHOLDS, "fp8", validate.Thresholds(1.0, 0.75, math.nextafter(rel, 0)))
    assert not compare(ref_logits, cand, PROMPTS, TEXT, "fp8")["passed"]
