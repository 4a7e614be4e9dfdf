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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from modelfleet.converters import progress

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


def compare(ref: LogitsFn, cand: LogitsFn, prompts: list[list[int]], text: list[int], dtype: str) -> dict:
    """Metrics and verdict (camelCase keys: this dict goes into manifest.json and the operator's status)."""
    limits = THRESHOLDS[dtype]
    max_diff, agree, total, ref_logits_all = 0.0, 0, 0, []
    with progress.task("validate", len(prompts) + 1) as bar:
        for ids in prompts:
            r, c = ref(ids), cand(ids)
            if not torch.isfinite(c).all():
                max_diff = math.inf
            max_diff = max(max_diff, (r - c).abs().max().item())
            agree += (r.argmax(-1) == c.argmax(-1)).sum().item()
            total += len(ids)
            ref_logits_all.append(r)
            bar.advance()
        ppl_ref, ppl_cand = perplexity(ref(text), text), perplexity(cand(text), text)
        bar.advance()
    ref_std = torch.cat(ref_logits_all).std().item()
    top1 = agree / total
    ppl_rel = abs(ppl_cand - ppl_ref) / ppl_ref if math.isfinite(ppl_cand) else math.inf
    max_allowed = limits.max_logit_diff_std * ref_std
    failures = []
    if not max_diff <= max_allowed:
        failures.append(f"max |logit diff| {max_diff:.4g} > {max_allowed:.4g}")
    if top1 < limits.min_top1_agreement:
        failures.append(f"top-1 agreement {top1:.3f} < {limits.min_top1_agreement}")
    if not ppl_rel <= limits.max_perplexity_rel_diff:
        failures.append(f"perplexity diff {ppl_rel:.4f} > {limits.max_perplexity_rel_diff}")
    return {
        "passed": not failures,
        "maxAbsLogitDiff": _round(max_diff),
        "top1Agreement": round(top1, 4),
        "perplexityRef": _round(ppl_ref),
        "perplexity": _round(ppl_cand),
        "perplexityRelDiff": _round(ppl_rel),
        "numPositions": total,
        "numDistinctTextIds": len(set(text)),
        "thresholds": {**asdict(limits), "maxAbsLogitDiff": _round(max_allowed)},
        "failures": failures,
    }


def _round(x: float) -> float | str:
    return float(f"{x:.6g}") if math.isfinite(x) else "inf"
