"""Where a step's time goes on the GPU: wall time, GPU busy time and the kernels, host time.

N requests with random prompts of --input-len (EOS ignored) are prefilled, timed and profiled as a
whole (steps, wall and GPU busy time, top kernels). Then, in steady decode after a warm-up, --steps
engine steps run under torch.profiler: the sum of kernel times per step is the GPU's busy time, the rest
of the wall time is the GPU waiting on the host. The same steps under cProfile give the host's Python
functions. Prints one JSON line (per-step figures in ms, top kernels) and, with --tables, the profiler's
tables on stderr.

    python bench/decode_profile.py --preset llama-3.2-1b --batch 1 --batch 256
    python bench/decode_profile.py --preset llama-3.2-1b --batch 1 --quantize int8  # its int8 artifact
    python bench/decode_profile.py --preset llama-3.2-1b --batch 1 --quantize int8 --quantize-lm-head
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time

import numpy as np
import torch
from throughput import PRESETS, build_preset, quantized_artifact


def start_decode(llm, batch: int, input_len: int, steps: int, temperature: float, vocab: int) -> dict:
    """Adds `batch` requests and runs their prefills (timed and profiled), then a few decode steps."""
    from modelfleet.dataplane import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=4 * steps + 64)
    for i in range(batch):
        llm.add_request(f"p{batch}-{i}", rng.integers(16, vocab, size=input_len).tolist(), params)
    scheduler = llm.engine.scheduler
    torch.cuda.synchronize()
    start, num_steps = time.perf_counter(), 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running
        ):
            llm.step()
            num_steps += 1
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    for _ in range(8):
        llm.step()  # warm-up decodes
    kernels = kernel_times(prof)
    return {
        "steps": num_steps,
        "tokens": batch * input_len,
        "wall_ms": round(1e3 * wall, 2),
        "gpu_busy_ms": round(sum(sum(v) for v in kernels.values()) / 1e3, 2),
        "top_kernels_us": [[name[:90], round(sum(v), 1)] for name, v in top_kernels(kernels, 8)],
    }


def kernel_times(prof) -> dict[str, list[float]]:
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time)
    return kernels


def top_kernels(kernels: dict[str, list[float]], n: int) -> list:
    return sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:n]


def profile_batch(llm, batch: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    prefill = start_decode(llm, batch, args.input_len, args.steps, args.temperature, args.vocab)
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        llm.step()
        walls.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            llm.step()
        torch.cuda.synchronize()
    kernels = kernel_times(prof)
    busy_us = sum(sum(v) for v in kernels.values()) / args.steps
    top = top_kernels(kernels, 18)
    if args.tables:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        llm.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    if args.tables:
        print(s.getvalue(), file=sys.stderr)
    for rid in list(llm.engine.scheduler.requests):
        llm.abort(rid)
    wall_ms = 1e3 * float(np.median(walls))
    return {
        "batch": batch,
        "prefill": prefill,
        "wall_ms_per_step": round(wall_ms, 3),
        "tokens_per_s": round(batch / wall_ms * 1e3, 1),
        "gpu_busy_ms_per_step": round(busy_us / 1e3, 3),
        "gpu_idle_ms_per_step": round(wall_ms - busy_us / 1e3, 3),
        "kernels_per_step": round(sum(len(v) for v in kernels.values()) / args.steps, 1),
        "top_kernels_us_per_step": [
            [name[:90], round(sum(v) / args.steps, 1), round(len(v) / args.steps, 1)] for name, v in top
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--preset-dir", default=None)
    parser.add_argument("--batch", type=int, action="append", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tables", action="store_true")
    parser.add_argument("--quantize", choices=["int8", "fp8"], help="profile the per-channel artifact")
    parser.add_argument("--quantize-lm-head", action="store_true", help="that artifact quantizes lm_head too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from modelfleet.dataplane import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = build_preset(args.preset, args.preset_dir or tmp, "cuda")
        if args.quantize:
            model = quantized_artifact(
                model, args.quantize, f"{tmp}/{args.quantize}", "cuda", lm_head=args.quantize_lm_head
            )
        with open(f"{model}/config.json") as f:
            args.vocab = json.load(f)["vocab_size"]
        llm = LLM(
            model,
            device="cuda",
            max_num_seqs=max(args.batch),
            max_model_len=args.input_len + 4 * args.steps + 64,
            enable_prefix_caching=False,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enforce_eager=args.enforce_eager,
        )
        result = {
            "bench": "decode_profile",
            "model": args.preset,
            "quantize": args.quantize,
            "quantize_lm_head": args.quantize_lm_head,
            "device": torch.cuda.get_device_name(),
            "temperature": args.temperature,
            "runs": [profile_batch(llm, b, args) for b in args.batch],
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
