"""Decode-linear benchmark: the Triton GEMV against F.linear (cuBLAS) on the Llama-3.2-1B and Llama-3-8B
projection shapes, M = 1 token by default.

Each measurement captures 20 back-to-back calls in one CUDA graph and replays it, so launch costs are those
of a captured decode step; consecutive calls read different weight copies (more bytes than the L2 holds),
as a model's consecutive layers do. Prints one JSON line: microseconds per call, weight-read TB/s, speedup.

    python bench/gemv.py [--m 1 2 4] [--dtype bfloat16]
    python bench/gemv.py --weight-dtype int8 [--weight-dtype fp8]   # also the GEMV on 1-byte weights

--weight-dtype adds, per shape, the GEMV reading the same weights quantized per channel (int8, or fp8
e4m3 on GPUs that have it) with their scales: `<fmt>_us`, `<fmt>_tbps` (its weight and scale bytes read
per second), `<fmt>_speedup` over the bf16 GEMV of the same shape, measured the same way, and
`<fmt>_cvt_us`: the same launch decoding its bytes with conversion instructions instead of bit operations.
    python bench/gemv.py --sweep [--budget-s 150] [--out results.json]   # time a grid of launch configs
    python bench/gemv.py --sweep --weight-dtype int8                     # the same for 1-byte weights

--sweep compiles the grid in parallel worker processes first (Triton's disk cache keeps the kernels), then
times every config of every shape and M and reports the fastest; its winners are gemv.py's TUNED table.

--as-model times (and sweeps) each projection as a Llama decode layer calls it (LlamaDecoderLayer.
forward_fused): qkv and gate_up with the RMSNorm inside (norm=), o with the residual add (residual=), down
with SiLU-and-mul and the residual add, the lm_head plain. The fused calls are what a decode step spends
its time in, and they rank launch configs differently from the plain GEMV.
    python bench/gemv.py --as-model --weight-dtype int8 --weight-dtype fp8
    python bench/gemv.py --as-model --sweep --weight-dtype int8
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# (model, projection, N, K): the fused qkv, o, fused gate_up and down projections
SHAPES = [
    ("llama-1b", "qkv_proj", 3072, 2048),
    ("llama-1b", "o_proj", 2048, 2048),
    ("llama-1b", "gate_up_proj", 16384, 2048),
    ("llama-1b", "down_proj", 2048, 8192),
    ("llama-1b", "lm_head", 128256, 2048),  # its tied embeddings, as a quantized lm_head reads them
    ("llama-8b", "qkv_proj", 6144, 4096),
    ("llama-8b", "o_proj", 4096, 4096),
    ("llama-8b", "gate_up_proj", 28672, 4096),
    ("llama-8b", "down_proj", 4096, 14336),
    ("llama-8b", "lm_head", 128256, 4096),  # untied: it goes through the same op
]
# How forward_fused calls each projection's GEMV at decode (--as-model): the RMSNorm inside, the residual
# added in place, SiLU-and-mul of the gate_up output inside.
AS_MODEL = {
    "qkv_proj": {"norm": True},
    "o_proj": {"residual": True},
    "gate_up_proj": {"norm": True},
    "down_proj": {"silu_mul": True, "residual": True},
    "lm_head": {},
}
CALLS_PER_GRAPH = 20
ROTATE_BYTES = 256 << 20  # weight copies per shape until the set is ~5x the 50 MB L2
REPLAYS = 7


def weight_copies(n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    count = max(1, min(CALLS_PER_GRAPH, math.ceil(ROTATE_BYTES / (n * k * dtype.itemsize))))
    return [torch.randn(n, k, device=device).to(dtype) / math.sqrt(k) for _ in range(count)]


def graph_us(call, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Microseconds per call of `call(x, weight)`, CALLS_PER_GRAPH calls captured in one graph."""
    order = [weights[i % len(weights)] for i in range(CALLS_PER_GRAPH)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights:  # compile and warm outside the capture
            call(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in order:
            call(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    del graph
    return statistics.median(times)


def cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def gemv_call(config=None):
    from modelfleet.dataplane.kernels.gemv import gemv

    return lambda x, w, **fusion: gemv(x, w, config=config, **fusion)


def tbps(n: int, k: int, dtype: torch.dtype, us: float) -> float:
    return round(n * k * dtype.itemsize / us / 1e6, 3)


def quantized_copies(n: int, k: int, fmt: str, device: torch.device) -> list[tuple]:
    """(1-byte weight, float32 scale) pairs, as many as keep the set several times the L2."""
    from modelfleet.dataplane.quantization import quantize

    count = max(1, min(CALLS_PER_GRAPH, math.ceil(ROTATE_BYTES / (n * k))))
    return [quantize(torch.randn(n, k, device=device) / math.sqrt(k), fmt) for _ in range(count)]


def quantized_gemv(x: torch.Tensor, pair: tuple, config=None, **fusion) -> torch.Tensor:
    from modelfleet.dataplane.kernels.gemv import gemv

    return gemv(x, pair[0], scale=pair[1], config=config, **fusion)


def quantized_call(config=None):
    return lambda x, pair, **fusion: quantized_gemv(x, pair, config, **fusion)


def as_called(call, proj: str | None, n: int, k: int, m: int, dtype: torch.dtype, device, as_model: bool):
    """(call(x, weight), x): `call` plain with x [m, K], or (as_model) with the keywords forward_fused
    gives `proj`'s GEMV (AS_MODEL) and its x: [m, 2K] for the down projection's SiLU-and-mul. The norm's
    weight and the residual (added to in place, call after call) are made once here."""
    fusion = dict(AS_MODEL[proj]) if as_model else {}
    x = torch.randn(m, 2 * k if fusion.get("silu_mul") else k, device=device).to(dtype)
    if fusion.pop("norm", False):
        fusion["norm"] = (torch.rand(k, device=device).to(dtype) + 0.5, 1e-5)
    if fusion.pop("residual", False):
        fusion["residual"] = torch.zeros(m, n, device=device, dtype=dtype)
    return (lambda x, w: call(x, w, **fusion)), x


def compare(
    ms: list[int], dtype: torch.dtype, device: torch.device, weight_dtypes: list[str], as_model: bool = False
) -> dict:
    """Per shape and M: cuBLAS (plain), the GEMV and each 1-byte format's, plain or (as_model) as
    forward_fused calls them."""
    from modelfleet.dataplane.kernels.gemv import default_config

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for (model, proj, n, k), m in itertools.product(SHAPES, ms):
        silu_mul = as_model and AS_MODEL[proj].get("silu_mul", False)

        def timed(call, weights, proj=proj, n=n, k=k, m=m) -> float:
            fused, x = as_called(call, proj, n, k, m, dtype, device, as_model)
            return graph_us(fused, weights, x)

        weights = weight_copies(n, k, dtype, device)
        base = graph_us(cublas, weights, torch.randn(m, k, device=device).to(dtype))
        ours = timed(gemv_call(), weights)
        config = default_config(m, n, k, sms, silu_mul=silu_mul)
        no_pdl = timed(gemv_call(dataclasses.replace(config, use_pdl=False)), weights)
        del weights
        quantized = {}
        for fmt in weight_dtypes:
            pairs = quantized_copies(n, k, fmt, device)
            q_us = timed(quantized_call(), pairs)
            q_config = default_config(m, n, k, sms, 1, silu_mul=silu_mul)
            # the same launch decoding its bytes with conversion instructions instead of bit operations
            cvt_us = timed(quantized_call(dataclasses.replace(q_config, decode_bits=False)), pairs)
            quantized[f"{fmt}_us"] = round(q_us, 2)
            quantized[f"{fmt}_cvt_us"] = round(cvt_us, 2)
            quantized[f"{fmt}_tbps"] = round((n * k + 4 * n) / q_us / 1e6, 3)
            quantized[f"{fmt}_speedup"] = round(ours / q_us, 3)
            del pairs
        rows.append(
            {
                "model": model,
                "proj": proj,
                "n": n,
                "k": k,
                "m": m,
                "as_model": AS_MODEL[proj] if as_model else {},
                "cublas_us": round(base, 2),
                "gemv_us": round(ours, 2),
                "gemv_without_pdl_us": round(no_pdl, 2),
                "config": str(config),
                "cublas_tbps": tbps(n, k, dtype, base),
                "gemv_tbps": tbps(n, k, dtype, ours),
                "speedup": round(base / ours, 3),
                **quantized,
            }
        )
        torch.cuda.empty_cache()
    per_model = {}
    for model in dict.fromkeys(s[0] for s in SHAPES):
        for m in ms:
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            per_model[f"{model}_m{m}"] = {
                "cublas_us": round(sum(r["cublas_us"] for r in sel), 2),
                "gemv_us": round(sum(r["gemv_us"] for r in sel), 2),
                **{f"{f}_us": round(sum(r[f"{f}_us"] for r in sel), 2) for f in weight_dtypes},
            }
    return {"per_shape": rows, "per_layer_sum": per_model}


# ---- --sweep: a grid of launch configurations per (shape, M) ----


def _one_pass(proj: str) -> bool:
    """Whether forward_fused's call of proj keeps K whole in each program (a norm or a residual add)."""
    fusion = AS_MODEL[proj]
    return bool(fusion.get("norm") or fusion.get("residual"))


def sweep_configs(
    m: int, n: int, k: int, weight_bytes: int = 2, one_pass: bool = False, silu_mul: bool = False
) -> list:
    """The grid of launch configs for one shape; one_pass: no K split (the call would drop it); silu_mul:
    row blocks of at least SILU_MUL_MIN_BLOCK_N (what default_config gives the fused activation)."""
    from modelfleet.dataplane.kernels.gemv import MAX_ROWS_PER_PROGRAM, SILU_MUL_MIN_BLOCK_N, GemvConfig

    rows = min(m, MAX_ROWS_PER_PROGRAM)
    configs = []
    # 1-byte weights: wider K tiles move as many bytes per load as the bf16 ones
    block_ks = (256, 512, 1024) if weight_bytes == 2 else (512, 1024, 2048, 4096)
    for bn, bk, nw, at_end, split, pdl in itertools.product(
        (1, 2, 4, 8, 16), block_ks, (4, 8), (False, True), (1, 2, 4), (True, False)
    ):
        # fp32 accumulator (or product) registers per thread; a packed 1-byte tile decodes a quarter at a time
        per_thread = rows * bn * bk / (32 * nw) / (4 if weight_bytes == 1 else 1)
        if per_thread > 64 or per_thread < 2 or bk > k or k // split < 2 * bk or (one_pass and split > 1):
            continue
        if silu_mul and bn < SILU_MUL_MIN_BLOCK_N:
            continue
        if nw == 8 and bn * bk < 8192:
            continue
        row_blocks = math.ceil(n / bn)
        if (split > 1 and row_blocks >= 4 * 132) or row_blocks * split > 8192:
            continue
        configs.append(
            GemvConfig(block_n=bn, block_k=bk, num_warps=nw, split_k=split, reduce_at_end=at_end, use_pdl=pdl)
        )
    return configs


_WORKER_WEIGHTS: dict = {}


def _compile_task(task) -> str | None:
    m, config, dtype_name, fmt, proj = task
    from modelfleet.dataplane.quantization import quantize

    dtype = getattr(torch, dtype_name)
    try:
        if (dtype, fmt) not in _WORKER_WEIGHTS:
            w = torch.randn(4096, 16384, device="cuda")
            _WORKER_WEIGHTS[(dtype, fmt)] = quantize(w, fmt) if fmt else (w.to(dtype), None)
        w, scale = _WORKER_WEIGHTS[(dtype, fmt)]
        n, k = w.shape
        kernel = quantized_call(config) if fmt else gemv_call(config)
        # proj None: the plain GEMV; else the launch as forward_fused makes it for proj (AS_MODEL)
        call, x = as_called(kernel, proj, n, k, m, dtype, "cuda", proj is not None)
        call(x, (w, scale) if fmt else w)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # a config that does not compile is reported, not fatal
        return f"{config}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile(tasks: list, workers: int) -> list[str]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        return [e for e in pool.map(_compile_task, tasks, chunksize=4) if e]


def sweep(
    ms: list[int],
    dtype: torch.dtype,
    device: torch.device,
    budget_s: float,
    workers: int,
    progress_path: str | None,
    fmt: str | None = None,
    as_model: bool = False,
    top: int = 5,
) -> dict:
    """The fastest launch configs per shape and M, of bf16 weights or (fmt) 1-byte ones with scales; the
    GEMVs plain or (as_model) as forward_fused calls them."""
    t0 = time.monotonic()
    weight_bytes = 1 if fmt else 2
    grid = {
        (m, proj): sweep_configs(
            m,
            n,
            k,
            weight_bytes,
            one_pass=as_model and _one_pass(proj),
            silu_mul=as_model and AS_MODEL[proj].get("silu_mul", False),
        )
        for m in ms
        for _, proj, n, k in SHAPES
    }
    # one compile per distinct kernel: the shapes share their specialisations (N, K multiples of 16)
    # (the split count only changes the small reduce kernel, compiled on first use)
    tasks = sorted(
        {
            (
                m,
                dataclasses.replace(c, split_k=min(c.split_k, 2)),
                str(dtype).split(".")[1],
                fmt,
                proj if as_model and AS_MODEL[proj] else None,
            )
            for (m, proj), cs in grid.items()
            for c in cs
        },
        key=str,
    )
    try:
        compile_errors = precompile(tasks, workers)
    except Exception as exc:  # the timing loop below compiles what is missing, only slower
        compile_errors = [f"parallel compile failed: {type(exc).__name__}: {str(exc)[:300]}"]
    compile_s = time.monotonic() - t0
    results, skipped = [], 0
    for m in ms:
        for model, proj, n, k in SHAPES:
            if time.monotonic() - t0 > budget_s:
                skipped += 1
                continue
            kernel = quantized_call if fmt else gemv_call
            # the GEMV at its default launch config, and the x every config is timed on
            default_call, x = as_called(kernel(), proj, n, k, m, dtype, device, as_model)
            if fmt:
                from modelfleet.dataplane.quantization import dequantize

                weights = quantized_copies(n, k, fmt, device)
                want = None if as_model else F.linear(x.float(), dequantize(*weights[0]).float())
                base = graph_us(default_call, weights, x)
            else:
                weights = weight_copies(n, k, dtype, device)
                want = None if as_model else F.linear(x.float(), weights[0].float())
                base = graph_us(cublas, weights, x) if not as_model else float("nan")
            timed = []
            for config in grid[(m, proj)]:
                if time.monotonic() - t0 > budget_s:
                    break
                call, _ = as_called(kernel(config), proj, n, k, m, dtype, device, as_model)
                try:
                    # the plain GEMV's error against float32 (a fused call's is the kernel tests')
                    err = 0.0 if want is None else (call(x, weights[0]).float() - want).abs().max().item()
                    timed.append((graph_us(call, weights, x), err, config))
                except Exception as exc:
                    compile_errors.append(
                        f"{config} at m={m} n={n} k={k}: {type(exc).__name__}: {str(exc)[:200]}"
                    )
            timed.sort(key=lambda t: t[0])
            try:
                default_us = base if fmt else graph_us(default_call, weights, x)
            except Exception as exc:
                default_us = float("nan")
                compile_errors.append(f"default config at m={m} n={n} k={k}: {type(exc).__name__}")
            results.append(
                {
                    "model": model,
                    "proj": proj,
                    "m": m,
                    "n": n,
                    "k": k,
                    "cublas_us": None if fmt or as_model else round(base, 2),
                    "default_us": round(default_us, 2),
                    "tried": len(timed),
                    "max_err": round(max((t[1] for t in timed), default=0.0), 5),
                    "best": [
                        {
                            "us": round(us, 2),
                            "tbps": round(n * k * weight_bytes / us / 1e6, 3),
                            "config": str(c),
                        }
                        for us, _, c in timed[:top]
                    ],
                }
            )
            del weights
            torch.cuda.empty_cache()
            if progress_path:  # keep what was measured if a later shape fails or time runs out
                with open(progress_path, "w") as f:
                    json.dump(results, f)
    return {
        "compile_s": round(compile_s, 1),
        "kernels_compiled": len(tasks),
        "errors": compile_errors[:20],
        "shapes_skipped_for_time": skipped,
        "results": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1], help="token counts (rows of x)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument(
        "--weight-dtype",
        action="append",
        default=[],
        choices=["int8", "fp8"],
        help="also time the GEMV on these 1-byte weights (--sweep: sweep the first of them, not bf16)",
    )
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch configurations")
    parser.add_argument(
        "--as-model", action="store_true", help="each GEMV as the Llama decode layer calls it (AS_MODEL)"
    )
    parser.add_argument("--budget-s", type=float, default=150.0, help="--sweep: stop timing after this")
    parser.add_argument("--workers", type=int, default=14, help="--sweep: parallel compile processes")
    parser.add_argument("--top", type=int, default=5, help="--sweep: the fastest configs reported per shape")
    parser.add_argument("--out", help="also write the result to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gemv.py: needs a CUDA GPU with Triton", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.sweep:
        progress = f"{args.out}.partial" if args.out else None
        fmt = args.weight_dtype[0] if args.weight_dtype else None
        result = sweep(
            args.m, dtype, device, args.budget_s, args.workers, progress, fmt, args.as_model, args.top
        )
    else:
        result = compare(args.m, dtype, device, args.weight_dtype, args.as_model)
    result = {
        "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        "as_model": args.as_model,
        **result,
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
