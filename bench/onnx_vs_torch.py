"""CPU decode throughput: the engine on ONNX artifacts (onnxruntime) against the engine on torch, same model.

Converts the model with `modelfleet convert` (ONNX float32 and onnxruntime int8) and generates the same
batch of random-token prompts with each, EOS ignored, so every side produces batch x output-len tokens.
The torch engine in float32 is the baseline. Prints one JSON line with tokens/s of each and the ratios.

    python bench/onnx_vs_torch.py                       # the small demo model (~100M parameters)
    python bench/onnx_vs_torch.py --model DIR --batch 8 --input-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="HF model folder (default: a fresh demo model)")
    parser.add_argument("--size", default="small", choices=("tiny", "small"), help="demo model size")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--work-dir", type=Path, help="where artifacts go (default: a temp folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each side keeps its best")
    return parser.parse_args()


def convert_artifacts(model: Path, work: Path) -> dict[str, dict]:
    from modelfleet.converters.convert import Request, convert

    results = {}
    for dtype in ("fp32", "int8"):
        started = time.monotonic()
        summary = convert(Request(str(model), "cpu", work / f"onnx-{dtype}", format="onnx", dtype=dtype,
                                  cache_dir=work / "cache"))  # fmt: skip
        results[dtype] = {
            "dir": work / f"onnx-{dtype}",
            "seconds": time.monotonic() - started,
            "summary": summary,
        }
    return results


def torch_runner(model: Path, prompts: list[list[int]], output_len: int):
    from modelfleet.dataplane import LLM

    llm = LLM(
        str(model), dtype="float32", device="cpu", enable_prefix_caching=False, max_num_seqs=len(prompts)
    )
    return engine_runner(llm, prompts, output_len)


def engine_runner(llm, prompts: list[list[int]], output_len: int):
    from modelfleet.dataplane import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up

    def run() -> float:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        assert all(len(o.token_ids) == output_len for o in outputs)
        return elapsed

    return run


def onnx_runner(artifact: Path, prompts: list[list[int]], output_len: int, threads: int):
    """The ONNX engine: the torch engine's request loop over onnxruntime."""
    import functools

    from modelfleet.dataplane import LLM
    from modelfleet.dataplane.onnx_engine import graph_engine
    from modelfleet.dataplane.onnx_runner import OnnxRunner

    graph = functools.partial(OnnxRunner, num_threads=threads)
    return engine_runner(LLM(graph_engine(artifact, graph, max_num_seqs=len(prompts))), prompts, output_len)


def main() -> int:
    args = parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="onnx-vs-torch-"))
    model = args.model
    if model is None:
        from modelfleet.dataplane.demo import create_demo_model

        model = create_demo_model(work / f"demo-{args.size}", size=args.size, force=True)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(16, vocab, size=args.input_len).tolist() for _ in range(args.batch)]
    print(f"converting {model} to ONNX (fp32, int8)...", file=sys.stderr)
    artifacts = convert_artifacts(model, work)
    tokens = args.batch * args.output_len
    runners = {"torch": torch_runner(model, prompts, args.output_len)}
    runners |= {
        d: onnx_runner(a["dir"], prompts, args.output_len, args.threads) for d, a in artifacts.items()
    }
    # Rounds alternate the sides so a change in machine load hits all of them; each keeps its best round.
    best = {name: float("inf") for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            best[name] = min(best[name], run())
    torch_s, onnx_s = best["torch"], {d: best[d] for d in artifacts}
    result = {
        "bench": "onnx_vs_torch",
        "model": str(model),
        "device": "cpu",
        "threads": args.threads,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "baseline": "torch_engine_fp32",
        "torch_engine_fp32_tok_s": round(tokens / torch_s, 1),
        "onnx_fp32_tok_s": round(tokens / onnx_s["fp32"], 1),
        "onnx_int8_tok_s": round(tokens / onnx_s["int8"], 1),
        "onnx_fp32_vs_torch": round(torch_s / onnx_s["fp32"], 3),
        "onnx_int8_vs_torch": round(torch_s / onnx_s["int8"], 3),
        "convert_seconds": {d: round(a["seconds"], 1) for d, a in artifacts.items()},
        "artifact_bytes": {d: a["summary"]["sizeBytes"] for d, a in artifacts.items()},
        "validation": {d: a["summary"]["validation"] for d, a in artifacts.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
