"""Validation of an artifact against its source: transformers runs the source in float32 as the reference.

On fixed prompts we compare the logits at every position: the largest |difference|, and how often the
most likely next token agrees. On a fixed text we compare perplexity. Thresholds are per dtype (below);
the logit threshold is in units of the reference logits' standard deviation, so one table fits models
whose logits live on different scales.

| dtype | max abs logit diff (x std of ref logits) | top-1 agreement >= | perplexity rel diff <= |
| fp32  | 0.001                                    | 0.99               | 0.001                  |
| fp16  | 0.05                                     | 0.97               | 0.01                   |
| bf16  | 0.25                                     | 0.90               | 0.03                   |
| int8  | 0.50                                     | 0.85               | 0.05                   |
| fp8   | 1.00                                     | 0.75               | 0.10                   |

Measured on the demo models (random weights, so the top two logits are often close and top-1 agreement is
a harsh test): small bf16 0.97-0.98, int8 0.95, fp8 0.79-0.81 (e4m3 keeps 3 mantissa bits; on a GPU the
activations are quantized too). Trained checkpoints have far more decisive logits; tighten per model if
needed, never loosen to publish a failing artifact.

Quantized artifacts against the bf16 baseline (rule "relative-to-bf16"). The table's int8 and fp8 rows
allow 2x and 4x the bf16 row's logit difference, but the formats' own rounding is 3.3x and 13x bf16's. On
one linear (Gaussian x and weights) the relative output error is bf16 (x, weight and output rounded)
0.29%, fp8 e4m3 weights with per-token e4m3 activations 3.73% at every width, and int8 per-channel weights
0.85% 2048 wide to 0.95% 14336 wide (the 8B preset's MLP): a row's int8 scale follows its maximum, which
grows with the row's width, so int8's ratio runs from 2.9x to 3.3x and RELATIVE_RATIOS takes the widest
(checked by the tests; the 8B's layers measure 0.90% and, down_proj, 0.97% on the GPU). Through a whole
model the logit difference grows in proportion to the per-layer error; how much it grows is the model's
property (random weights: much more than trained ones). Validation ids, float32 reference, max (RMS) logit
difference; the bf16 max moves with the GPU's kernels (8B: 0.420 on an H100, 0.375 on an H200), the RMS
is the steadier figure:

| preset, GPU | bf16               | int8           | fp8           | int8 / bf16  | fp8 / bf16  |
| 1B, H100    | 0.117 (0.13 std)   | 0.314          | 1.238         | 2.7          | 10.6        |
| 8B, H100    | 0.420 (0.33 std)   | 1.140          | 4.034         | 2.7          | 9.6         |
| 1B, H200    | 0.112 (RMS 0.0192) | 0.314 (0.0563) | 1.238 (0.221) | 2.8 (2.9)    | 11.0 (11.5) |
| 8B, H200    | 0.375 (RMS 0.0622) | 1.140 (0.184)  | 4.034 (0.665) | 3.04 (2.97)  | 10.7 (10.7) |

The ratios sit under the formats' 3.3x and 13x, so each artifact is as close as its format allows (with
3.0, the 2048-wide figure, the 8B's faithful int8 artifact failed on the H200 by 1%); but the 8B's bf16
artifact alone is over its own 0.25 limit, and on the 1B a faithful fp8 artifact would need bf16 under
0.08 std to meet the fp8 row: the absolute rows measured the random weights' gain, not the conversion.
So when a bf16 baseline of the source is measured in the same validation, a quantized
artifact's logit limit is the larger of its row's and RELATIVE_RATIOS x the baseline's own max difference
(a broken layer, e.g. one layer's scales off, goes far past either). Top-1 agreement is then judged on
the positions the serving dtype itself decides: where the reference's lead over its runner-up exceeds
three standard deviations of what that dtype's rounding moves the lead by. A logit's error has the RMS of
the logit differences, the format's expected one RELATIVE_RATIOS x the baseline's measured RMS, and a
lead moves by the difference of two such errors (sqrt(2) x the RMS), so at those positions a faithful
artifact flips the top token about once in a thousand. At the others even a faithful artifact flips it:
on the 8B preset fp8 (one linear 13x bf16's error) flipped 3 of the 6 positions that led by twice
*bf16's* max difference, this rule's first form (its RMS logit error there: 10.7x bf16's). Random weights
lead by ~std / 5 on a 128k vocabulary, so on the presets few or no positions are decisive for fp8 and the
logit limit and perplexity judge it; trained checkpoints lead by several logits. Perplexity keeps its
absolute row. The report names the rule and gives both figures (`rule`, `baseline`), the margin, and each
decisive position whose top token flipped: the reference's lead there and how far that row's logits moved
(`decisiveFlips`). A failed conversion logs the whole report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from modelfleet.converters import progress

# Decisive flips listed in a report, at most.
MAX_FLIPS = 16

PROMPTS = (
    "The scheduler looks at the running sequences after every step, and",
    "Quantization trades a little accuracy for a lot of memory because",
    "Hello. How are you today? Tell me how a model server decides which request goes first.",
    "A recipe for a simple soup: cut two onions and fry them slowly in butter until",
)
PERPLEXITY_TEXT = (
    "Serving a language model is mostly a story about waiting. A request arrives with a prompt, the prompt "
    "is cut into tokens, and the tokens are pushed through the network once to fill the cache. After that "
    "the model produces one token at a time."
)


@dataclass(frozen=True)
class Thresholds:
    max_logit_diff_std: float  # allowed max |diff| in units of the reference logits' std
    min_top1_agreement: float
    max_perplexity_rel_diff: float


THRESHOLDS: dict[str, Thresholds] = {
    "fp32": Thresholds(0.001, 0.99, 0.001),
    "fp16": Thresholds(0.05, 0.97, 0.01),
    "bf16": Thresholds(0.25, 0.90, 0.03),
    "int8": Thresholds(0.50, 0.85, 0.05),
    "fp8": Thresholds(1.00, 0.75, 0.10),
}

# A candidate maps token ids [T] to float32 logits [T, vocab].
LogitsFn = Callable[[list[int]], torch.Tensor]

BASELINE_DTYPE = "bf16"
# A format's relative output error on one linear over bf16's, int8's at the widest rows the presets have
# (see the module docstring): how much larger than the bf16 baseline's its logit difference may be.
RELATIVE_RATIOS = {"int8": 3.3, "fp8": 13.0}
RATIO_WIDTH = 14336
# A position decides the top token for a dtype when the reference's lead is this many standard deviations
# of the lead's expected movement (see the module docstring).
DECISIVE_SIGMAS = 3.0


@dataclass(frozen=True)
class Baseline:
    """The bf16 model of the source against the same float32 reference, on the same prompts."""

    dtype: str
    max_abs_logit_diff: float
    top1_agreement: float
    rms_logit_diff: float

    def decisive_margin(self, dtype: str) -> float:
        """The lead over which `dtype`'s own rounding flips the top token about once in a thousand."""
        return DECISIVE_SIGMAS * math.sqrt(2) * RELATIVE_RATIOS[dtype] * self.rms_logit_diff


def cached(fn: LogitsFn) -> LogitsFn:
    """`fn` computed once per id sequence (the reference is compared with the baseline, then the artifact)."""
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def run(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in memo:
            memo[key] = fn(ids)
        return memo[key]

    return run


def measure_baseline(
    ref: LogitsFn, base: LogitsFn, prompts: list[list[int]], dtype: str = BASELINE_DTYPE
) -> Baseline:
    max_diff, squares, agree, total = 0.0, 0.0, 0, 0
    for ids in prompts:
        r, b = ref(ids), base(ids)
        max_diff = max(max_diff, (r - b).abs().max().item()) if torch.isfinite(b).all() else math.inf
        squares += (r - b).double().square().sum().item()
        agree += (r.argmax(-1) == b.argmax(-1)).sum().item()
        total += len(ids)
    rms = math.sqrt(squares / (total * ref(prompts[0]).shape[-1]))
    return Baseline(dtype, max_diff, agree / total, rms if math.isfinite(max_diff) else math.inf)


def token_ids(model_dir: Path, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """The fixed prompts and text as ids: through the model's tokenizer when it has one, else a fixed
    pseudo-random id sequence (so a tokenizer-less checkpoint is still validated).

    A tokenizer that maps the texts onto a few ids (one whose vocabulary lacks English words maps them all
    to its unknown token) would make every position predict the same token: one logit's quantization
    error then repeats at every position instead of averaging out, and perplexity differences measure
    that one logit (8 to 22 times the error of varied ids, on a random-weight Llama). Such a tokenizer is
    set aside for the pseudo-random ids."""
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        prompts = [tok.encode(p).ids for p in PROMPTS]
        text = tok.encode(PERPLEXITY_TEXT).ids
        if len(set(text)) * 2 >= len(text):
            return prompts, text
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, vocab_size, (16,), generator=g).tolist() for _ in PROMPTS]
    return prompts, torch.randint(0, vocab_size, (48,), generator=g).tolist()


def reference(source: Path) -> LogitsFn:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    return hf_logits_fn(model)


def hf_logits_fn(model: torch.nn.Module) -> LogitsFn:
    device = next(model.parameters()).device

    @torch.no_grad()
    def run(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu()

    return run


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def compare(
    ref: LogitsFn,
    cand: LogitsFn,
    prompts: list[list[int]],
    text: list[int],
    dtype: str,
    baseline: Baseline | None = None,
) -> dict:
    """Metrics and verdict (camelCase keys: this dict goes into manifest.json and the operator's status).
    With a bf16 `baseline` measured on the same prompts, an int8/fp8 artifact is judged relative to it
    (the module docstring's "relative-to-bf16" rule); otherwise, and for other dtypes, by the table."""
    limits = THRESHOLDS[dtype]
    relative = baseline is not None and dtype in RELATIVE_RATIOS and baseline.dtype == BASELINE_DTYPE
    decisive_margin = baseline.decisive_margin(dtype) if baseline is not None and relative else math.inf
    max_diff, squares, agree, total, ref_logits_all = 0.0, 0.0, 0, 0, []
    decisive_agree, decisive_total = 0, 0
    flips: list[tuple[float, float]] = []  # (reference's lead, row's max |diff|) where a decisive top-1 flips
    with progress.task("validate", len(prompts) + 1) as bar:
        for ids in prompts:
            r, c = ref(ids), cand(ids)
            if not torch.isfinite(c).all():
                max_diff = math.inf
            max_diff = max(max_diff, (r - c).abs().max().item())
            squares += (r - c).double().square().sum().item()
            same = r.argmax(-1) == c.argmax(-1)
            agree += same.sum().item()
            total += len(ids)
            top2 = r.topk(2, dim=-1).values
            lead = top2[:, 0] - top2[:, 1]
            decisive = lead > decisive_margin
            decisive_agree += (same & decisive).sum().item()
            decisive_total += decisive.sum().item()
            flipped = decisive & ~same
            if flipped.any():
                row_diff = (r - c).abs().max(dim=-1).values
                flips += zip(lead[flipped].tolist(), row_diff[flipped].tolist(), strict=True)
            ref_logits_all.append(r)
            bar.advance()
        ppl_ref, ppl_cand = perplexity(ref(text), text), perplexity(cand(text), text)
        bar.advance()
    ref_std = torch.cat(ref_logits_all).std().item()
    rms = math.sqrt(squares / sum(r.numel() for r in ref_logits_all))
    top1 = agree / total
    ppl_rel = abs(ppl_cand - ppl_ref) / ppl_ref if math.isfinite(ppl_cand) else math.inf
    absolute_allowed = limits.max_logit_diff_std * ref_std
    max_allowed = absolute_allowed
    judged_top1, top1_what = top1, "top-1 agreement"
    if relative:
        assert baseline is not None
        ratio = RELATIVE_RATIOS[dtype]
        max_allowed = max(absolute_allowed, ratio * baseline.max_abs_logit_diff)
        # the undecided positions flip with the serving dtype's own rounding; with none decisive,
        # top-1 agreement cannot tell this artifact from a faithful one and is not judged
        decisive_top1 = decisive_agree / decisive_total if decisive_total else None
        judged_top1 = decisive_top1 if decisive_top1 is not None else 1.0
        top1_what = f"top-1 agreement on the {decisive_total} decisive positions"
    failures = []
    if not max_diff <= max_allowed:
        failures.append(f"max |logit diff| {max_diff:.4g} > {max_allowed:.4g}")
    if judged_top1 < limits.min_top1_agreement:
        failures.append(f"{top1_what} {judged_top1:.3f} < {limits.min_top1_agreement}")
    if not ppl_rel <= limits.max_perplexity_rel_diff:
        failures.append(f"perplexity diff {ppl_rel:.4f} > {limits.max_perplexity_rel_diff}")
    report: dict = {
        "passed": not failures,
        "rule": "relative-to-bf16" if relative else "absolute",
        "maxAbsLogitDiff": _round(max_diff),
        "rmsLogitDiff": _round(rms),
        "top1Agreement": round(top1, 4),
        "perplexityRef": _round(ppl_ref),
        "perplexity": _round(ppl_cand),
        "perplexityRelDiff": _round(ppl_rel),
        "numPositions": total,
        "numDistinctTextIds": len(set(text)),
        "thresholds": {**asdict(limits), "maxAbsLogitDiff": _round(max_allowed)},
        "failures": failures,
    }
    if relative:
        assert baseline is not None
        report["thresholds"]["absoluteMaxAbsLogitDiff"] = _round(absolute_allowed)
        report["thresholds"]["relativeRatio"] = RELATIVE_RATIOS[dtype]
        report["top1AgreementDecisive"] = None if decisive_top1 is None else round(decisive_top1, 4)
        report["numDecisivePositions"] = decisive_total
        report["decisiveMargin"] = _round(decisive_margin)
        # What a flip there had to overcome and how far that row's logits moved: the data to tell a
        # flip within the format's own error from one past it (the smallest leads first).
        report["decisiveFlips"] = [
            {"lead": _round(lead), "rowMaxAbsDiff": _round(diff)} for lead, diff in sorted(flips)[:MAX_FLIPS]
        ]
        report["baseline"] = {
            "dtype": baseline.dtype,
            "maxAbsLogitDiff": _round(baseline.max_abs_logit_diff),
            "rmsLogitDiff": _round(baseline.rms_logit_diff),
            "top1Agreement": round(baseline.top1_agreement, 4),
        }
    return report


def _round(x: float) -> float | str:
    return float(f"{x:.6g}") if math.isfinite(x) else "inf"
