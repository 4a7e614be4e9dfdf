"""The decode GEMV's machine code for a GPU that need not be here, and what its loop over K costs.

Triton compiles for a target named by hand (`GPUTarget("cuda", 90, 32)` is Hopper) and its wheel carries
ptxas and nvdisasm, so a launch configuration's SASS can be read on any machine: per weight, the
instructions of the K loop, the barriers in it (layout conversions through shared memory) and any spill
stores. One JSON line per configuration. The counts rank nothing by themselves (on an H200 the form with
the fewest instructions a weight ran slower: docs/benchmarks.md, 2026-11-28); they show what a change did
to the code before a GPU times it.

    python bench/gemv_sass.py --weights int8 --config 4,1024,4 --config 16,1024,8 [--fusion norm] [--dump]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gemv import AS_MODEL

# The kernel's flag for each of gemv()'s fusion keywords.
_FLAGS = {"norm": "NORM", "residual": "ADD_RESIDUAL", "silu_mul": "SILU_MUL"}
# Each kind of GEMV forward_fused launches (bench/gemv.py's AS_MODEL), as the kernel's flags.
FUSIONS = {
    name: {_FLAGS[key]: True for key in AS_MODEL[proj]}
    for name, proj in (
        ("none", "lm_head"),
        ("norm", "qkv_proj"),
        ("residual", "o_proj"),
        ("silu_mul", "down_proj"),
    )
}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def compile_gemv(weights: str, block_n: int, block_k: int, num_warps: int, fusion: str, arch: int, rows: int):
    """The GEMV kernel compiled for sm_<arch>, as gemv() launches it on decode shapes (N, K and the strides
    multiples of 16, K whole tiles)."""
    import triton
    from modelfleet.dataplane.kernels import gemv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    packed = weights != "bf16"
    signature = {
        "x_ptr": "*bf16",
        "w_ptr": "*i32" if packed else "*bf16",
        "bias_ptr": "*bf16",
        "scale_ptr": "*fp32",
        "out_ptr": "*bf16",
        "norm_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_xm": "i32",
        "stride_wn": "i32",
        "stride_om": "i32",
        "k_per_split": "i32",
        "eps": "fp32",
    }
    flags = {
        "HAS_BIAS": False,
        "HAS_SCALE": packed,
        "PARTIAL": False,
        "BLOCK_M": rows,
        "MASK_M": False,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "EVEN_K": True,
        "REDUCE_AT_END": True,
        "USE_PDL": arch >= 90,
        "PACKED": packed,
        "FP8": weights == "fp8",
        "PTX": True,
        "SILU_MUL": False,
        "NORM": False,
        "ADD_RESIDUAL": False,
        **FUSIONS[fusion],
    }
    names = list(signature) + list(flags)
    signature.update(dict.fromkeys(flags, "constexpr"))
    aligned = [i for i, name in enumerate(names[:14]) if name not in ("M", "eps")]
    source = ASTSource(
        gemv._gemv_kernel,
        signature,
        constexprs={(names.index(name),): value for name, value in flags.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def disassemble(cubin: bytes) -> list[str]:
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run(
            [str(nvdisasm), "-c", file.name], capture_output=True, text=True, check=True
        ).stdout.splitlines()


def k_loop(sass: list[str]) -> list[str]:
    """The instructions of the longest loop: from a label to the branch back to it."""
    labels: dict[str, int] = {}
    best: list[str] = []
    for i, line in enumerate(sass):
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = i
        branch = _BRANCH.search(line)
        if branch and branch.group(1) in labels:
            body = [s for s in sass[labels[branch.group(1)] : i + 1] if _INSTRUCTION.search(s)]
            best = max(best, body, key=len)
    return best


def report(
    weights: str, config: tuple[int, int, int], fusion: str, arch: int, rows: int
) -> tuple[dict, list[str]]:
    block_n, block_k, num_warps = config
    kernel = compile_gemv(weights, block_n, block_k, num_warps, fusion, arch, rows)
    sass = disassemble(kernel.asm["cubin"])
    loop = k_loop(sass)
    opcodes = collections.Counter(_INSTRUCTION.search(s).group(2).split(".")[0] for s in loop)
    per_thread = block_n * block_k / (32 * num_warps)  # weights a thread multiplies per pass of the loop
    line = {
        "bench": "gemv_sass",
        "arch": f"sm_{arch}",
        "weights": weights,
        "fusion": fusion,
        "rows": rows,
        "block_n": block_n,
        "block_k": block_k,
        "num_warps": num_warps,
        "loop_instructions": len(loop),
        "instructions_per_weight": round(len(loop) / (per_thread * rows), 2),
        "loop_barriers": opcodes["BAR"],
        "spill_stores": sum(" STL" in s for s in sass),
        "top_opcodes": dict(opcodes.most_common(8)),
    }
    return line, sass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=["bf16", "int8", "fp8"], default="int8")
    parser.add_argument(
        "--config", action="append", default=[], help="BLOCK_N,BLOCK_K,WARPS (repeatable; default 4,1024,4)"
    )
    parser.add_argument("--fusion", choices=sorted(FUSIONS), default="none")
    parser.add_argument("--rows", type=int, default=1, choices=[1, 2, 3, 4], help="rows of x a program takes")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper), 80")
    parser.add_argument("--dump", action="store_true", help="print the SASS too")
    args = parser.parse_args(argv)
    configs = [tuple(int(v) for v in c.split(",")) for c in args.config] or [(4, 1024, 4)]
    for config in configs:
        if len(config) != 3:
            parser.error(f"--config takes BLOCK_N,BLOCK_K,WARPS, got {config}")
        line, sass = report(args.weights, config, args.fusion, args.arch, args.rows)
        if args.dump:
            print("\n".join(sass), file=sys.stderr)
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
