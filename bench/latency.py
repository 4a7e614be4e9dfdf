"""Batch-1 decode latency: our engine against Hugging Face `generate` in the same run, and the roofline.

One prompt of --input-len random token ids, greedy, --output-len tokens (EOS ignored), repeated
--repeats times after a warm-up. Ours: decode rate from the request's first-token and finish times.
Hugging Face: (generate of N tokens) - (generate of 1 token), over N - 1 tokens; optionally again with
its static cache (`--hf-static`: its decode is compiled). Roofline: one decode step must read every
weight once plus the KV cache, at the measured copy bandwidth. Prints one JSON line.

    python bench/latency.py --device cuda --preset llama-3.2-1b
    python bench/latency.py --model DIR --input-len 32 --output-len 32      # CPU

--tensor-parallel N also runs the engine split over N ranks after the one-rank run: `engine_tpN` and
`speedup_tpN` (decode tokens/s over TP=1).

    python bench/latency.py --device cuda --preset llama-3.1-8b --tensor-parallel 2 --skip-hf

--quantize int8 / --quantize fp8 (repeatable) also runs the engine on the converter's per-channel
artifact of the same model (quantized on --device into a temporary folder) after the source model's
run, on the same prompt: `engine_int8` with its own weight bytes and roofline, and `speedup_int8`
(decode tokens/s over the source model's run, the baseline measured in the same process).

    python bench/latency.py --device cuda --preset llama-3.2-1b --quantize int8 --quantize fp8 --skip-hf

--quantize-lm-head: those artifacts quantize lm_head too (the converter's opt-in); the JSON says which.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from throughput import (
    PRESETS,
    build_preset,
    copy_bandwidth_gbps,
    kv_bytes_per_token,
    model_args_problem,
    quantized_artifact,
    weight_bytes_per_step,
)


def run_engine(
    args: argparse.Namespace,
    prompt: list[int],
    result: dict,
    tensor_parallel: int = 1,
    model: str | None = None,
) -> dict:
    """Decode rates of args.model (or `model`, a quantized artifact of it); a one-rank run records the
    model's weight and KV bytes in `result`."""
    from modelfleet.dataplane import LLM, SamplingParams

    llm = LLM(
        model or args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=1,
        max_model_len=len(prompt) + args.output_len,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=tensor_parallel,
    )
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([prompt], params)  # warm-up (kernel compilation, allocator)
    rates, ttfts = [], []
    for _ in range(args.repeats):
        (out,) = llm.generate([prompt], params)
        assert len(out.token_ids) == args.output_len
        rates.append((args.output_len - 1) / (out.finished_time - out.first_token_time))
        ttfts.append(out.first_token_time - out.arrival_time)
    runner = llm.engine.runner
    if tensor_parallel == 1:  # a rank's weights are a share of these
        result["weight_bytes_per_step"] = weight_bytes_per_step(runner.model)
        result["kv_bytes_per_token"] = kv_bytes_per_token(runner.model, runner.dtype)
        result["cuda_graphs"] = runner.decode_graphs is not None
    llm.engine.close()  # the other ranks' processes
    del llm, runner
    free_memory(args.device)
    return summary(rates, ttfts)


def run_hf(args: argparse.Namespace, prompt: list[int], static: bool) -> dict:
    from modelfleet.dataplane.engine.model_runner import resolve_dtype
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=resolve_dtype(args.dtype, device)).to(
        device
    )
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=device)
    extra = {"cache_implementation": "static"} if static else {}

    def generate(n: int, model=model) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == len(prompt) + n
        return time.perf_counter() - start

    for _ in range(2 if static else 1):  # warm-up (the static cache's compilation)
        generate(args.output_len)
    rates, ttfts = [], []
    for _ in range(args.repeats):
        first = generate(1)
        full = generate(args.output_len)
        rates.append((args.output_len - 1) / (full - first))
        ttfts.append(first)
    del model
    free_memory(args.device)
    return summary(rates, ttfts)


def roofline(args: argparse.Namespace, sizes: dict, engine: dict) -> float:
    """Decode tokens/s if a mean step only read every weight and the KV of the mean context at the
    measured copy bandwidth; notes the engine's share of it in `engine`."""
    mean_context = args.input_len + args.output_len / 2
    step_bytes = sizes["weight_bytes_per_step"] + mean_context * sizes["kv_bytes_per_token"]
    tokens_per_s = sizes["copy_bandwidth_gbps"] * 1e9 / step_bytes
    engine["pct_of_roofline"] = round(100 * engine["decode_tokens_per_s"] / tokens_per_s, 1)
    return round(tokens_per_s, 1)


def summary(rates: list[float], ttfts: list[float]) -> dict:
    rate = statistics.median(rates)
    return {
        "decode_tokens_per_s": round(rate, 1),
        "ms_per_token": round(1e3 / rate, 3),
        "decode_tokens_per_s_runs": [round(r, 1) for r in rates],
        "ttft_ms": round(1e3 * statistics.median(ttfts), 2),
    }


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="Hugging Face checkpoint folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--preset-dir", default=None, help="build the preset here and keep it (reused if present)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--hf-static", action="store_true", help="also run HF with its static (compiled) cache"
    )
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, help="also run the engine over N ranks (after TP=1)"
    )
    parser.add_argument(
        "--quantize",
        action="append",
        choices=["int8", "fp8"],
        help="also run the engine on this quantized artifact of the model (repeatable): engine_<fmt>",
    )
    parser.add_argument(
        "--quantize-lm-head", action="store_true", help="every --quantize artifact quantizes lm_head too"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tensor_parallel < 1:
        print("--tensor-parallel: must be at least 1", file=sys.stderr)
        return 2
    if problem := model_args_problem(args):
        print(problem, file=sys.stderr)
        return 2
    if args.quantize_lm_head and not args.quantize:
        print("--quantize-lm-head: applies to the --quantize artifacts; name one", file=sys.stderr)
        return 2
    if args.output_len < 2:
        print("--output-len: needs at least 2 tokens (a decode rate needs decode steps)", file=sys.stderr)
        return 2
    if args.model is not None and not os.path.isdir(args.model):
        print(f"--model: {args.model} is not a directory", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-preset-") as tmp:
        if args.preset is not None:
            args.model = build_preset(args.preset, args.preset_dir or tmp, args.device)
        print(json.dumps(run(args)))
    return 0


def run(args: argparse.Namespace) -> dict:
    with open(os.path.join(args.model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    prompt = np.random.default_rng(args.seed).integers(16, vocab_size, size=args.input_len).tolist()
    result: dict = {
        "benchmark": "latency",
        "model": args.preset or args.model,
        "device": args.device,
        "batch_size": 1,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
    }
    if args.quantize:
        result["quantize_lm_head"] = args.quantize_lm_head
    if args.device == "cuda":
        result["device_name"] = torch.cuda.get_device_name()
        result["copy_bandwidth_gbps"] = round(copy_bandwidth_gbps(torch.device("cuda")), 1)
    result["engine"] = run_engine(args, prompt, result)
    if args.tensor_parallel > 1:
        tp = args.tensor_parallel
        result[f"engine_tp{tp}"] = run_engine(args, prompt, result, tp)
        result[f"speedup_tp{tp}"] = round(
            result[f"engine_tp{tp}"]["decode_tokens_per_s"] / result["engine"]["decode_tokens_per_s"], 2
        )
    if "copy_bandwidth_gbps" in result:
        result["roofline_tokens_per_s"] = roofline(args, result, result["engine"])
    for fmt in args.quantize or []:
        with tempfile.TemporaryDirectory(prefix=f"bench-{fmt}-") as tmp:
            record: dict = {}
            artifact = quantized_artifact(args.model, fmt, tmp, args.device, args.quantize_lm_head)
            record["engine"] = run_engine(args, prompt, record, model=artifact)
        engine = result[f"engine_{fmt}"] = record["engine"]
        engine["weight_bytes_per_step"] = record["weight_bytes_per_step"]
        if "copy_bandwidth_gbps" in result:
            engine["roofline_tokens_per_s"] = roofline(args, result | record, engine)
        result[f"speedup_{fmt}"] = round(
            engine["decode_tokens_per_s"] / result["engine"]["decode_tokens_per_s"], 2
        )
    if not args.skip_hf:
        runs = {"hf": False, **({"hf_static": True} if args.hf_static else {})}
        for name, static in runs.items():
            result[name] = run_hf(args, prompt, static)
            if "roofline_tokens_per_s" in result:
                result[name]["pct_of_roofline"] = round(
                    100 * result[name]["decode_tokens_per_s"] / result["roofline_tokens_per_s"], 1
                )
            result[f"ratio_vs_{name}"] = round(
                result["engine"]["decode_tokens_per_s"] / result[name]["decode_tokens_per_s"], 2
            )
    return result


if __name__ == "__main__":
    sys.exit(main())
