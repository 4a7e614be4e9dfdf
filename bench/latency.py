"""Batch-1 decode latency: our engine against Hugging Face `generate` in the same run, and the roofline.

One prompt of --input-len random token ids, greedy, --output-len tokens (EOS ignored), repeated
--repeats times after a warm-up. Ours: decode rate from the request's first-token and finish times
(every run's, their median and best), and the time of each decode step: wall-clock, the host's own work
in it (less the wait for the GPU's tokens) and, on CUDA, the GPU's from CUDA events around the step's
launch (median per run, slowest per run, median overall). Host time close to wall time, GPU time well
below it: the host sets the pace (a slow or shared CPU shows there); GPU time moving with the wall time
and the SM clock (`sm_clock_mhz_runs`): the GPU does.
Hugging Face: (generate of N tokens) - (generate of 1 token), over N - 1 tokens; optionally again with
its static cache (`--hf-static`: its decode is compiled). Roofline: one decode step must read every
weight once plus the KV cache, at the measured copy bandwidth. Prints one JSON line.

    python bench/latency.py --device cuda --preset llama-3.2-1b
    python bench/latency.py --model DIR --input-len 32 --output-len 32      # CPU

--quantize int8 / --quantize fp8 (repeatable) also runs the engine on the converter's per-channel
artifact of the same model (quantized on --device into a temporary folder), on the same prompt:
`engine_int8` with its own weight bytes and roofline. Every engine is built once and kept (an 8B model
in bf16, int8 and fp8 takes about 32 GB), and the runs are interleaved (bf16, int8, fp8, bf16, ...): a
slow spell of a shared host or GPU then falls on every format alike. Ratios to the source model's:
`speedup_int8` (median decode tokens/s), `_best` (best runs), `_step` (median step, blind to a few
stalled steps) and `_device` (median GPU time per step, blind to the host).

    python bench/latency.py --device cuda --preset llama-3.2-1b --quantize int8 --quantize fp8 --skip-hf \
        --repeats 7

--quantize-lm-head: those artifacts quantize lm_head too (the converter's opt-in); the JSON says which.

--tensor-parallel N also runs the engine split over N ranks after those: `engine_tpN` and `speedup_tpN`
(decode tokens/s over TP=1).

    python bench/latency.py --device cuda --preset llama-3.1-8b --tensor-parallel 2 --skip-hf
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from throughput import (
    PRESETS,
    DecodeStepTimer,
    build_preset,
    copy_bandwidth_gbps,
    kv_bytes_per_token,
    model_args_problem,
    quantized_artifact,
    weight_bytes_per_step,
)


def build_engine(args: argparse.Namespace, prompt_len: int, model: str, tensor_parallel: int = 1):
    """An engine for one batch-1 request of prompt_len + --output-len tokens."""
    from modelfleet.dataplane import LLM

    return LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=1,
        max_model_len=prompt_len + args.output_len,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=tensor_parallel,
    )


class DecodeRuns:
    """Decode runs of one engine on one prompt: each run's rate from the request's first-token and finish
    times, and the time of each of its decode steps (DecodeStepTimer): wall-clock, the host's own work in
    it and, on CUDA, the GPU's (CUDA events around each launch). A run whose rate drops while its GPU time
    per step does not lost time on the host; then the host's time per step is close to the wall time."""

    def __init__(self, llm, prompt: list[int], output_len: int, device: str) -> None:
        from modelfleet.dataplane import SamplingParams

        self.llm, self.prompt, self.output_len = llm, prompt, output_len
        self.params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
        llm.generate([prompt], self.params)  # warm-up (kernel compilation, allocator)
        self.timer = DecodeStepTimer(llm, device_events=device == "cuda")

    def __call__(self) -> dict:
        self.timer.clear()
        (out,) = self.llm.generate([self.prompt], self.params)
        assert len(out.token_ids) == self.output_len
        # The first decode step's launch also waits for the prefill's tokens: left out.
        decode = [i for i, step in enumerate(self.timer.steps) if step[0]][1:]
        device = self.timer.device_seconds()
        return {
            "rate": (self.output_len - 1) / (out.finished_time - out.first_token_time),
            "ttft": out.first_token_time - out.arrival_time,
            "step_s": [self.timer.steps[i][3] for i in decode],
            "host_step_s": [self.timer.steps[i][3] - self.timer.waits[i] for i in decode],
            "device_step_s": [device[i] for i in decode] if device else [],
            "sm_clock_mhz": sm_clock_mhz() if device else None,
        }


def sm_clock_mhz() -> int | None:
    """The GPU's SM clock as NVML last sampled it (None without NVML): batch-1 steps of a small model
    are hundreds of short kernels whose times follow this clock, where a large model's follow memory."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # no pynvml, or NVML refused
        return None


def interleave(runs: dict[str, Callable[[], dict]], repeats: int) -> dict[str, list[dict]]:
    """`repeats` rounds of one run of each, in order (a, b, c, a, b, c, ...): a slow spell of the host
    or the GPU then falls on every format alike rather than on whichever ran during it."""
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    return results


def engine_sizes(llm, record: dict) -> None:
    runner = llm.engine.runner
    record["weight_bytes_per_step"] = weight_bytes_per_step(runner.model)
    record["kv_bytes_per_token"] = kv_bytes_per_token(runner.model, runner.dtype)
    record["cuda_graphs"] = runner.decode_graphs is not None


def close_engines(engines: list, device: str) -> None:
    for llm in engines:
        llm.engine.close()  # the other ranks' processes
    engines.clear()
    free_memory(device)


def run_formats(args: argparse.Namespace, prompt: list[int], result: dict) -> None:
    """The source model (`engine`) and each --quantize artifact (`engine_<fmt>`), every engine built
    once and kept, their runs interleaved; then the ratios to the source's."""
    names = ["engine"] + [f"engine_{fmt}" for fmt in args.quantize or []]
    records: dict[str, dict] = {name: {} for name in names}
    engines: list = []
    runs: dict[str, Callable[[], dict]] = {}
    with contextlib.ExitStack() as stack:
        for name, fmt in zip(names, [None, *(args.quantize or [])], strict=True):
            model = args.model
            if fmt is not None:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"bench-{fmt}-"))
                model = quantized_artifact(args.model, fmt, tmp, args.device, args.quantize_lm_head)
            engines.append(build_engine(args, len(prompt), model))
            engine_sizes(engines[-1], records[name])
            runs[name] = DecodeRuns(engines[-1], prompt, args.output_len, args.device)
        measured = interleave(runs, args.repeats)
        del runs
        close_engines(engines, args.device)
    result.update(records["engine"])  # its weight and KV bytes, and whether decode ran CUDA graphs
    result["engine"] = summary(measured["engine"])
    if "copy_bandwidth_gbps" in result:
        result["roofline_tokens_per_s"] = roofline(args, result, result["engine"])
    for fmt in args.quantize or []:
        engine = result[f"engine_{fmt}"] = summary(measured[f"engine_{fmt}"])
        engine["weight_bytes_per_step"] = records[f"engine_{fmt}"]["weight_bytes_per_step"]
        if "copy_bandwidth_gbps" in result:
            engine["roofline_tokens_per_s"] = roofline(args, result | records[f"engine_{fmt}"], engine)
        result.update(speedups(fmt, engine, result["engine"]))


def speedups(name: str, engine: dict, base: dict) -> dict[str, float]:
    """`engine` over `base`: decode tokens/s, median runs (speedup_<name>) and best runs (_best); per step,
    median wall time (_step: blind to a few stalled steps) and median GPU time (_device: to the host),
    where both timed steps (none are timed at --output-len 2: the one decode step waits for the prefill)."""
    out = {
        f"speedup_{name}": engine["decode_tokens_per_s"] / base["decode_tokens_per_s"],
        f"speedup_{name}_best": engine["decode_tokens_per_s_best"] / base["decode_tokens_per_s_best"],
    }
    for suffix, key in (("step", "step_ms_median"), ("device", "device_step_ms_median")):
        if key in base and key in engine:
            out[f"speedup_{name}_{suffix}"] = base[key] / engine[key]
    return {k: round(v, 2) for k, v in out.items()}


def run_tensor_parallel(args: argparse.Namespace, prompt: list[int], result: dict) -> None:
    tp = args.tensor_parallel
    llm = build_engine(args, len(prompt), args.model, tp)
    runs = DecodeRuns(llm, prompt, args.output_len, args.device)
    measured = [runs() for _ in range(args.repeats)]
    del runs
    close_engines([llm], args.device)
    result[f"engine_tp{tp}"] = summary(measured)
    result[f"speedup_tp{tp}"] = round(
        result[f"engine_tp{tp}"]["decode_tokens_per_s"] / result["engine"]["decode_tokens_per_s"], 2
    )


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
    runs = []
    for _ in range(args.repeats):
        first = generate(1)
        full = generate(args.output_len)
        runs.append({"rate": (args.output_len - 1) / (full - first), "ttft": first})
    del model
    free_memory(args.device)
    return summary(runs)


def roofline(args: argparse.Namespace, sizes: dict, engine: dict) -> float:
    """Decode tokens/s if a mean step only read every weight and the KV of the mean context at the
    measured copy bandwidth; notes the engine's share of it in `engine`."""
    mean_context = args.input_len + args.output_len / 2
    step_bytes = sizes["weight_bytes_per_step"] + mean_context * sizes["kv_bytes_per_token"]
    tokens_per_s = sizes["copy_bandwidth_gbps"] * 1e9 / step_bytes
    engine["pct_of_roofline"] = round(100 * engine["decode_tokens_per_s"] / tokens_per_s, 1)
    return round(tokens_per_s, 1)


def summary(runs: list[dict]) -> dict:
    """Decode tokens/s of every run, their median and best; TTFT; decode step times (ms): the median of
    each run's steps and its slowest, and the median over all runs' steps: wall-clock, the host's own
    work (wall-clock less the wait for the GPU's tokens) and GPU (where the runs timed them); the GPU's SM
    clock after each run where NVML reads it."""
    rates = [r["rate"] for r in runs]
    rate = statistics.median(rates)
    out = {
        "decode_tokens_per_s": round(rate, 1),
        "decode_tokens_per_s_best": round(max(rates), 1),
        "ms_per_token": round(1e3 / rate, 3),
        "decode_tokens_per_s_runs": [round(r, 1) for r in rates],
        "ttft_ms": round(1e3 * statistics.median(r["ttft"] for r in runs), 2),
    }
    for key in [k for k in ("step_s", "host_step_s", "device_step_s") if all(r.get(k) for r in runs)]:
        name = key.removesuffix("_s")
        out[f"{name}_ms_median"] = ms(statistics.median(t for r in runs for t in r[key]))
        out[f"{name}_ms_median_runs"] = [ms(statistics.median(r[key])) for r in runs]
        out[f"{name}_ms_max_runs"] = [ms(max(r[key])) for r in runs]
    if all(r.get("sm_clock_mhz") is not None for r in runs):
        out["sm_clock_mhz_runs"] = [r["sm_clock_mhz"] for r in runs]
    return out


def ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


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
    run_formats(args, prompt, result)
    if args.tensor_parallel > 1:
        run_tensor_parallel(args, prompt, result)
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
