"""The "relative-to-bf16" rule: an int8/fp8 artifact judged against the bf16 model of its source measured in
the same validation. Made-up logits for each limit, then a real random-weight Llama on the CPU whose int8
artifact passes and fails once one layer's scales are corrupted."""

from __future__ import annotations

import json
import math

import pytest
import torch
from modelfleet.converters import validate
from modelfleet.converters.validate import DECISIVE_SIGMAS, RELATIVE_RATIOS, THRESHOLDS, Baseline, compare

VOCAB = 16
PROMPTS = [[p * 100 + i for i in range(20)] for p in range(4)]  # 80 positions
TEXT = list(range(12))


def ref_logits(ids: list[int]) -> torch.Tensor:
    """Position i of a prompt leads by 1.2 when i is even (decisive), by 0.01 when odd (not)."""
    g = torch.Generator().manual_seed(ids[0])
    rows = torch.randn(len(ids), VOCAB, generator=g).clamp(-1.0, 1.0)
    for pos, row in enumerate(rows):
        row[ids[pos] % VOCAB] = 5.0
        row[(ids[pos] + 1) % VOCAB] = 5.0 - (1.2 if pos % 2 == 0 else 0.01)
    return rows


def std() -> float:
    return torch.cat([ref_logits(ids) for ids in PROMPTS]).std().item()


def candidate(*, diff: float = 0.0, flip_odd: int = 0, flip_even: int = 0):
    """The reference with `diff` added to one low logit, and the top two swapped at the first `flip_odd`
    undecided and `flip_even` decisive positions."""

    def run(ids: list[int]) -> torch.Tensor:
        logits = ref_logits(ids).clone()
        if ids is TEXT or ids == TEXT:
            return logits
        p = PROMPTS.index(ids)
        for pos in range(len(ids)):
            n = p * 10 + pos // 2  # index among the prompts' positions of the same parity
            if (pos % 2 == 1 and n < flip_odd) or (pos % 2 == 0 and n < flip_even):
                a, b = ids[pos] % VOCAB, (ids[pos] + 1) % VOCAB
                logits[pos, a], logits[pos, b] = logits[pos, b].item(), logits[pos, a].item()
        if p == 1 and diff:
            logits[3, int(logits[3].argmin())] += diff
        return logits

    return run


def baseline(max_diff: float, top1: float = 1.0, rms: float | None = None) -> Baseline:
    return Baseline("bf16", max_diff, top1, max_diff / 10 if rms is None else rms)


def deciding(margin: float, dtype: str, max_diff: float = 0.5) -> Baseline:
    """A baseline whose RMS makes `dtype`'s decisive margin `margin`."""
    return baseline(max_diff, rms=margin / (DECISIVE_SIGMAS * math.sqrt(2) * RELATIVE_RATIOS[dtype]))


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_the_logit_limit_is_the_larger_of_the_row_and_the_ratio_times_the_baseline(dtype):
    absolute = THRESHOLDS[dtype].max_logit_diff_std * std()
    base = 2 * absolute / RELATIVE_RATIOS[dtype]  # the relative limit is twice the absolute one
    relative = RELATIVE_RATIOS[dtype] * base
    under = compare(ref_logits, candidate(diff=0.99 * relative), PROMPTS, TEXT, dtype, baseline(base))
    assert under["passed"], under["failures"]
    assert under["rule"] == "relative-to-bf16"
    assert under["thresholds"]["maxAbsLogitDiff"] == pytest.approx(relative, rel=1e-5)
    assert under["thresholds"]["absoluteMaxAbsLogitDiff"] == pytest.approx(absolute, rel=1e-5)
    assert under["baseline"] == {
        "dtype": "bf16",
        "maxAbsLogitDiff": pytest.approx(base, rel=1e-5),
        "rmsLogitDiff": pytest.approx(base / 10, rel=1e-5),
        "top1Agreement": 1.0,
    }
    over = compare(ref_logits, candidate(diff=1.01 * relative), PROMPTS, TEXT, dtype, baseline(base))
    assert not over["passed"] and over["failures"][0].startswith("max |logit diff|")
    # without a baseline the same artifact meets the table's row, which it is over
    table = compare(ref_logits, candidate(diff=0.99 * relative), PROMPTS, TEXT, dtype)
    assert table["rule"] == "absolute" and not table["passed"] and "baseline" not in table


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_a_tiny_baseline_leaves_the_absolute_row(dtype):
    absolute = THRESHOLDS[dtype].max_logit_diff_std * std()
    report = compare(ref_logits, candidate(diff=0.99 * absolute), PROMPTS, TEXT, dtype, baseline(1e-4))
    assert report["passed"] and report["thresholds"]["maxAbsLogitDiff"] == pytest.approx(absolute, rel=1e-5)
    report = compare(ref_logits, candidate(diff=1.01 * absolute), PROMPTS, TEXT, dtype, baseline(1e-4))
    assert not report["passed"]


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_top1_is_judged_on_the_positions_the_dtype_decides(dtype):
    base = deciding(1.0, dtype)  # decisive: a lead over 1.0, the even positions (40 of 80)
    floor = THRESHOLDS[dtype].min_top1_agreement
    allowed = math.floor(40 * (1 - floor) + 1e-9)  # decisive flips that still meet the row
    # every undecided position flipped: overall agreement 0.5, under every row, yet it passes
    ok = compare(ref_logits, candidate(flip_odd=40, flip_even=allowed), PROMPTS, TEXT, dtype, base)
    assert ok["passed"], ok["failures"]
    assert ok["numDecisivePositions"] == 40 and ok["top1Agreement"] < floor
    assert ok["top1AgreementDecisive"] == pytest.approx((40 - allowed) / 40, abs=1e-4)
    assert ok["decisiveMargin"] == pytest.approx(1.0)
    # each decisive flip is reported with the lead it overcame and how far its row moved (the swap)
    lead = 1.2
    assert (
        ok["decisiveFlips"] == [{"lead": pytest.approx(lead), "rowMaxAbsDiff": pytest.approx(lead)}] * allowed
    )
    bad = compare(ref_logits, candidate(flip_even=allowed + 1), PROMPTS, TEXT, dtype, base)
    assert len(bad["decisiveFlips"]) == allowed + 1
    every = compare(ref_logits, candidate(flip_even=40), PROMPTS, TEXT, dtype, base)
    assert len(every["decisiveFlips"]) == validate.MAX_FLIPS  # a report stays short
    assert bad["top1Agreement"] >= floor  # overall fine; the decisive positions are not
    assert not bad["passed"] and bad["failures"] == [
        f"top-1 agreement on the 40 decisive positions {(39 - allowed) / 40:.3f} < {floor}"
    ]
    # the table alone fails the undecided flips
    assert not compare(ref_logits, candidate(flip_odd=40), PROMPTS, TEXT, dtype)["passed"]


def test_a_lead_of_exactly_the_margin_is_not_decisive():
    """Decisive: the reference's lead exceeds the margin; at exactly the margin, not."""
    top2 = ref_logits(PROMPTS[0])[0].topk(2).values
    lead = (top2[0] - top2[1]).item()  # every even position's lead, as compare() computes it
    at = compare(ref_logits, candidate(), PROMPTS, TEXT, "int8", deciding(lead, "int8"))
    assert at["numDecisivePositions"] == 0 and at["thresholds"]["relativeRatio"] == RELATIVE_RATIOS["int8"]
    under = compare(ref_logits, candidate(), PROMPTS, TEXT, "int8", deciding(0.999 * lead, "int8"))
    assert under["numDecisivePositions"] == 40


def test_the_margin_is_three_sigmas_of_the_dtypes_expected_lead_movement():
    """The lead moves by the difference of two logit errors, each of the dtype's expected RMS (its ratio
    times the baseline's): fp8's margin is 13/3 of int8's on the same baseline."""
    base = baseline(0.5, rms=0.01)
    for dtype in ("int8", "fp8"):
        expected = DECISIVE_SIGMAS * math.sqrt(2) * RELATIVE_RATIOS[dtype] * 0.01
        report = compare(ref_logits, candidate(), PROMPTS, TEXT, dtype, base)
        assert report["decisiveMargin"] == pytest.approx(expected, rel=1e-5)  # the report keeps 6 digits
        assert base.decisive_margin(dtype) == pytest.approx(expected)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_with_no_decisive_position_top1_is_not_judged(dtype):
    """Where no lead is beyond the dtype's own error, agreement cannot tell a faithful artifact from a
    broken one: the report says so (null) and the logit limit and perplexity judge the artifact."""
    every = compare(
        ref_logits, candidate(flip_odd=40, flip_even=40), PROMPTS, TEXT, dtype, deciding(2.0, dtype)
    )
    assert every["numDecisivePositions"] == 0 and every["top1AgreementDecisive"] is None
    assert every["top1Agreement"] == 0.0 and every["decisiveFlips"] == []
    assert not any("top-1" in f for f in every["failures"]), every["failures"]


def test_other_dtypes_and_baselines_keep_the_table():
    base = baseline(10.0)
    for dtype in ("bf16", "fp16", "fp32"):
        assert compare(ref_logits, candidate(), PROMPTS, TEXT, dtype, base)["rule"] == "absolute"
    fp16_base = Baseline("fp16", 10.0, 1.0, 1.0)
    assert compare(ref_logits, candidate(), PROMPTS, TEXT, "int8", fp16_base)["rule"] == "absolute"


def test_the_ratios_are_the_formats_rounding_over_bf16s():
    """RELATIVE_RATIOS is the relative output error of one linear in each format over bf16's (x, weight and
    output rounded to bf16), at the widest rows it covers; int8's grows with the width, fp8's does not."""
    from modelfleet.dataplane.quantization import dequantize, quantize

    def ratios(width: int) -> tuple[float, float]:
        torch.manual_seed(0)
        w = torch.randn(512, width) * 0.02
        x = torch.randn(64, width)
        y = x @ w.T

        def rel(out: torch.Tensor) -> float:
            return ((out - y).norm() / y.norm()).item()

        xb = x.bfloat16().float()
        bf16 = rel((xb @ w.bfloat16().float().T).bfloat16().float())
        int8 = rel(xb @ dequantize(*quantize(w, "int8")).T)
        x_scale = x.abs().amax(dim=1, keepdim=True) / 448
        x_fp8 = (x / x_scale).to(torch.float8_e4m3fn).float() * x_scale
        fp8 = rel(x_fp8 @ dequantize(*quantize(w, "fp8")).T)
        return int8 / bf16, fp8 / bf16

    int8_wide, fp8_wide = ratios(validate.RATIO_WIDTH)
    assert int8_wide == pytest.approx(RELATIVE_RATIOS["int8"], rel=0.04)
    assert fp8_wide == pytest.approx(RELATIVE_RATIOS["fp8"], rel=0.04)
    int8_narrow, fp8_narrow = ratios(2048)
    assert int8_narrow < 0.93 * int8_wide  # a narrower row's maximum, so its int8 scale, is smaller
    assert fp8_narrow == pytest.approx(fp8_wide, rel=0.04)


def test_the_reference_is_computed_once_per_prompt():
    calls = []
    ref = validate.cached(lambda ids: calls.append(ids) or ref_logits(ids))
    base = validate.measure_baseline(ref, candidate(diff=0.25), PROMPTS)
    assert base.max_abs_logit_diff == pytest.approx(0.25) and base.top1_agreement == 1.0
    assert base.rms_logit_diff == pytest.approx(math.sqrt(0.25**2 / (80 * VOCAB)))  # one logit of all
    compare(ref, candidate(), PROMPTS, TEXT, "int8", base)
    assert len(calls) == len(PROMPTS) + 1  # and the text once


# ---- a random-weight Llama on the CPU: its int8 artifact through the engine's QuantizedLinear ----


@pytest.fixture(scope="module")
def llama_and_int8(tmp_path_factory):
    import transformers
    from modelfleet.converters.checkpoint import read_checkpoint, write_torch

    # weights this wide amplify rounding enough that 3x the bf16 error is over the int8 row
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("relative")
    source = root / "source"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(source)
    artifact = root / "int8"
    artifact.mkdir()
    write_torch(read_checkpoint(source), artifact, dtype="bf16", quant="int8", serving_dtype="bf16")
    return source, artifact


def validate_int8(source, artifact) -> dict:
    from modelfleet.converters import candidates

    prompts, text = validate.token_ids(source, json.loads((source / "config.json").read_text())["vocab_size"])
    ref = validate.cached(validate.reference(source))
    base_fn, _ = candidates.torch_candidate(source, "bf16")
    base = validate.measure_baseline(ref, base_fn, prompts)
    cand, how = candidates.quantized_candidate(artifact, source, "int8", "bf16")
    return {**how, **compare(ref, cand, prompts, text, "int8", base)}


def test_a_good_int8_artifact_passes_relative_to_bf16(llama_and_int8):
    report = validate_int8(*llama_and_int8)
    assert report["passed"], report
    assert report["rule"] == "relative-to-bf16" and report["method"] == "quantized-kernels"
    assert 0 < report["baseline"]["maxAbsLogitDiff"] < report["maxAbsLogitDiff"]
    limits = report["thresholds"]
    assert limits["maxAbsLogitDiff"] > limits["absoluteMaxAbsLogitDiff"]  # the relative limit decides


def test_one_layers_corrupted_scales_fail_relative_to_bf16(llama_and_int8, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    source, artifact = llama_and_int8
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name] * 1.5  # a scale computed from the wrong maximum, in one layer
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    report = validate_int8(source, broken)
    assert not report["passed"], report
    assert report["rule"] == "relative-to-bf16"
    assert any(f.startswith("max |logit diff|") for f in report["failures"]), report["failures"]
