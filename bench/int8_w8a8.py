"""Where int8 W8A8 pays: bf16 F.linear, the weight-only int8 Triton matmul and W8A8 (per-token int8
activations, torch._int_mm, the scaling kernel) on the Llama-3.2-1B and Llama-3-8B projection shapes, per
row count M; the rows from which a CUDA int8 QuantizedLinear takes W8A8 (quantization.INT8_W8A8_MIN_ROWS)
should be where W8A8's sum over a model's projections drops under weight-only's.

Measured as bench/gemv.py does (calls captured in a CUDA graph, weight copies rotated past the L2). Prints
one JSON line: per shape and M the microseconds of each path (`int_mm_us`: torch._int_mm alone, on
activations quantized beforehand, so the quantizer's and the scaling's share shows), per model and M the
sums and speedups, and per model `w8a8_from_rows`: the smallest measured M from which W8A8 is faster than
weight-only at every larger measured M, next to the constant.

    python bench/int8_w8a8.py [--m 16 32 64 128 256 512 1024 2048] [--model llama-8b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import SHAPES, cublas, graph_us, quantized_copies, weight_copies

DEFAULT_M = [16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048]


def bench_shape(n: int, k: int, m: int, device: torch.device) -> dict:
    from modelfleet.dataplane.quantization import (
        int8_w8a8_matmul,
        int8_weight_only_matmul,
        quantize_rows_int8,
    )

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    bf16 = graph_us(cublas, weight_copies(n, k, torch.bfloat16, device), x)
    pairs = quantized_copies(n, k, "int8", device)
    weight_only = graph_us(lambda x, p: int8_weight_only_matmul(x, p[0], p[1]), pairs, x)
    row = {"m": m, "n": n, "k": k, "bf16_us": round(bf16, 2), "weight_only_us": round(weight_only, 2)}
    if m < 17 or n % 8 or k % 8:  # torch._int_mm's shape rules
        return row
    w8a8 = graph_us(lambda x, p: int8_w8a8_matmul(x, p[0], p[1]), pairs, x)
    x_q, _ = quantize_rows_int8(x)
    int_mm = graph_us(lambda xq, p: torch._int_mm(xq, p[0].t()), pairs, x_q)
    return row | {"w8a8_us": round(w8a8, 2), "int_mm_us": round(int_mm, 2)}


def summarize(rows: list[dict], ms: list[int]) -> dict:
    sums: dict[int, dict[str, float]] = {}
    for m in ms:
        at = [r for r in rows if r["m"] == m]
        if all("w8a8_us" in r for r in at):
            sums[m] = {key: sum(r[key] for r in at) for key in ("bf16_us", "weight_only_us", "w8a8_us")}
    per_m = {
        m: {k: round(v, 1) for k, v in s.items()}
        | {
            "w8a8_speedup_vs_weight_only": round(s["weight_only_us"] / s["w8a8_us"], 2),
            "w8a8_speedup_vs_bf16": round(s["bf16_us"] / s["w8a8_us"], 2),
            "weight_only_speedup_vs_bf16": round(s["bf16_us"] / s["weight_only_us"], 2),
        }
        for m, s in sums.items()
    }
    faster = [m for m in sums if sums[m]["w8a8_us"] < sums[m]["weight_only_us"]]
    # the smallest M from which W8A8 wins at every larger measured M
    from_rows = next((m for m in sorted(sums) if all(n in faster for n in sums if n >= m)), None)
    return {"per_m": per_m, "w8a8_from_rows": from_rows}


def main() -> int:
    from modelfleet.dataplane.quantization import INT8_W8A8_MIN_ROWS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=DEFAULT_M, help="rows of x (tokens)")
    parser.add_argument("--model", action="append", choices=["llama-1b", "llama-8b"], dest="models")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    models = args.models or ["llama-1b", "llama-8b"]
    result: dict = {"device": torch.cuda.get_device_name(), "INT8_W8A8_MIN_ROWS": INT8_W8A8_MIN_ROWS}
    for model in models:
        rows = [
            {"proj": proj} | bench_shape(n, k, m, device)
            for name, proj, n, k in SHAPES
            if name == model and proj != "lm_head"
            for m in args.m
        ]
        result[model] = {"per_shape": rows, **summarize(rows, args.m)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
