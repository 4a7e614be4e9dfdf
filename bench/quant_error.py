"""Where the error of a quantized artifact comes from: per-layer and end to end, against bf16.

Per layer: each Linear of the preset runs on the activations the bf16 model feeds it (the validation
prompts), once with its bf16 weight and once as the engine's QuantizedLinear (int8 weight-only, fp8
weights and per-token fp8 activations on GPUs with fp8); the relative error ||y_q - y|| / ||y|| is
reported per layer kind and for the worst layer, with the error of the weights alone (the dequantized
weight in bf16, so the activation quantization's share shows). End to end: the converter's own compare()
of the quantized model against transformers in float32, on the tokenizer's ids and on the validation's
inputs, with the unquantized bf16 model measured the same way as the baseline.

    python bench/quant_error.py --preset llama-3.2-1b --device cuda --dtype fp8 --dtype int8

Prints one JSON line; the bf16 model in the same run is the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import PRESETS, build_preset


def _capture_inputs(model: nn.Module, prompts: list[list[int]], device: str) -> dict[str, list]:
    inputs: dict[str, list[torch.Tensor]] = defaultdict(list)
    hooks = [
        module.register_forward_hook(lambda m, args, out, name=name: inputs[name].append(args[0].detach()))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith("lm_head")
    ]
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids], device=device))
    for hook in hooks:
        hook.remove()
    return inputs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def per_layer(model: nn.Module, inputs: dict[str, list[torch.Tensor]], fmt: str) -> dict:
    from modelfleet.dataplane.quantization import QuantizedLinear, dequantize_to, quantize

    kinds: dict[str, list[float]] = defaultdict(list)
    weights_only: dict[str, list[float]] = defaultdict(list)
    worst = ("", 0.0)
    with torch.no_grad():
        for name, xs in inputs.items():
            linear = model.get_submodule(name)
            q = QuantizedLinear.from_float(linear, fmt).to(linear.weight.device)
            w_q, scale = quantize(linear.weight, fmt)
            dev = linear.weight.device
            w_deq = dequantize_to(w_q.to(dev), scale.to(dev), linear.weight.dtype)
            kind = name.rsplit(".", 1)[-1]
            for x in xs:
                x2 = x.reshape(-1, x.shape[-1])
                y = linear(x2)
                err = _rel(q(x2), y)
                kinds[kind].append(err)
                weights_only[kind].append(_rel(x2 @ w_deq.T, y))
                if err > worst[1]:
                    worst = (name, err)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return {
        "relErrByKind": {k: round(mean(v), 5) for k, v in kinds.items()},
        "relErrWeightsOnlyByKind": {k: round(mean(v), 5) for k, v in weights_only.items()},
        "worstLayer": worst[0],
        "worstRelErr": round(worst[1], 5),
    }


def end_to_end(model_dir: Path, fmt: str, reference, baselines: dict) -> dict:
    """The converter's compare() of `fmt` against the float32 reference; fmt "bf16" is the unquantized
    artifact in the serving dtype, the baseline of the quantized rows: its figures go into `baselines`
    (per input set), and the quantized rows are judged relative to them as `modelfleet convert` does."""
    from modelfleet.converters import validate
    from modelfleet.converters.candidates import quantized_candidate, torch_candidate
    from modelfleet.dataplane.quantization import quantize

    config = json.loads((model_dir / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        artifact = Path(tmp)
        from safetensors.torch import load_file, save_file

        if fmt == "bf16":
            cand, info = torch_candidate(model_dir, "bf16")
        else:
            tensors = {}
            for shard in sorted(model_dir.glob("*.safetensors")):
                tensors.update(load_file(shard))
            out = {}
            for name, tensor in tensors.items():
                linear = name.endswith(".weight") and tensor.dim() == 2
                if linear and "embed" not in name and "lm_head" not in name:
                    out[name], out[name + "_scale"] = quantize(tensor, fmt)
                else:
                    out[name] = tensor
            save_file(out, str(artifact / "model.safetensors"))
            del tensors, out
            cand, info = quantized_candidate(artifact, model_dir, fmt, "bf16")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        inputs = {
            # What validation used before it set aside tokenizers that give few distinct ids.
            "tokenizerIds": (
                [tokenizer.encode(p).ids for p in validate.PROMPTS],
                tokenizer.encode(validate.PERPLEXITY_TEXT).ids,
            ),
            "validationInputs": validate.token_ids(model_dir, config["vocab_size"]),
        }
        report = {"method": info["method"]}
        keys = (
            "passed",
            "maxAbsLogitDiff",
            "rmsLogitDiff",
            "top1Agreement",
            "perplexityRelDiff",
            "numDistinctTextIds",
        )
        extra = ("rule", "thresholds", "baseline", "top1AgreementDecisive", "numDecisivePositions")
        extra += ("decisiveMargin", "decisiveFlips")
        for label, (prompts, text) in inputs.items():
            if fmt == "bf16":
                baselines[label] = validate.measure_baseline(reference, cand, prompts)
            r = validate.compare(reference, cand, prompts, text, fmt, baselines.get(label))
            report[label] = {k: r[k] for k in keys + extra if k in r} | {"failures": r["failures"]}
        del cand
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", action="append", choices=["int8", "fp8"], dest="dtypes")
    parser.add_argument("--model-dir", type=Path, help="reuse a built preset")
    args = parser.parse_args()
    model_dir = args.model_dir or Path(tempfile.mkdtemp()) / args.preset
    build_preset(args.preset, model_dir, args.device)
    from modelfleet.converters import validate
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(model_dir) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    prompts, _ = validate.token_ids(Path(model_dir), config["vocab_size"])
    inputs = _capture_inputs(model, prompts, args.device)
    result = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }
    for fmt in args.dtypes or ["int8", "fp8"]:
        result[fmt] = {"perLayer": per_layer(model, inputs, fmt)}
    del model, inputs
    if args.device == "cuda":
        torch.cuda.empty_cache()
    reference = validate.cached(validate.reference(Path(model_dir)))
    baselines: dict = {}
    result["bf16"] = {"endToEnd": end_to_end(Path(model_dir), "bf16", reference, baselines)}
    for fmt in args.dtypes or ["int8", "fp8"]:
        result[fmt]["endToEnd"] = end_to_end(Path(model_dir), fmt, reference, baselines)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
