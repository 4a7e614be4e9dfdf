"""The fp8 KV cache (kv_cache_dtype fp8) against the model-dtype cache: its error and the memory it saves.

Error: the engine's model (Triton kernels on a GPU) prefills --num-prompts random prompts and decodes
--decode-steps tokens, once with a cache in the model's dtype and once with an e4m3 cache (scales 1.0),
both fed the same tokens (the model-dtype cache's greedy ones); reported: max and mean |logit diff| over
every step's logits, top-1 agreement, and K/V's largest |value| (e4m3 saturates at 448).
Memory: KV blocks and sequences of --seq-len tokens that fit in --kv-cache-bytes for each cache dtype
(the engine's own block arithmetic), and on a GPU the blocks each engine allocates from the same
kv_cache_memory_fraction.

    python bench/kv_cache_fp8.py --preset llama-3.2-1b --device cuda

Prints one JSON line per measurement ("error", "capacity", and on a GPU "engine").
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import PRESETS, build_preset

BLOCK_SIZE = 16


def decode_logits(
    model, kv_dtype: torch.dtype, prompts: list[list[int]], steps: int, forced: list[list[int]] | None
) -> tuple[torch.Tensor, list[list[int]], float]:
    """Logits [steps + 1, B, vocab] (float32, on the CPU) of a batched prefill and `steps` batched decode
    steps in a cache of `kv_dtype`; the tokens fed (greedy, or `forced`); and the cache's largest |K/V|."""
    from modelfleet.dataplane.attention import AttentionMetadata

    mc, device = model.config, next(model.parameters()).device
    blocks_per_seq = -(-(max(len(p) for p in prompts) + steps) // BLOCK_SIZE)
    num_blocks = blocks_per_seq * len(prompts)
    shape = (mc.num_layers, 2, num_blocks, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim)
    caches = list(torch.zeros(shape, dtype=kv_dtype, device=device).unbind(0))
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    rows = []

    def step(query_lens: list[int]) -> torch.Tensor:
        seq_lens = [len(s) for s in seqs]
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=BLOCK_SIZE,
            device=device,
        )
        ids = [t for s, q in zip(seqs, query_lens, strict=True) for t in s[len(s) - q :]]
        positions = [p for s, q in zip(seqs, query_lens, strict=True) for p in range(len(s) - q, len(s))]
        hidden = model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), caches, meta)
        last = meta.query_start_loc[1:].long() - 1
        return model.compute_logits(hidden.index_select(0, last)).float()

    with torch.inference_mode():
        rows.append(step([len(s) for s in seqs]))
        for i in range(steps):
            chosen = rows[-1].argmax(-1).tolist() if forced is None else [f[i] for f in forced]
            for s, token in zip(seqs, chosen, strict=True):
                s.append(token)
            rows.append(step([1] * len(seqs)))
    amax = max(c.float().abs().max().item() for c in caches)
    return torch.stack(rows).cpu(), [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)], amax


def error(model_dir: str, device: str, num_prompts: int, prompt_len: int, steps: int) -> dict:
    from modelfleet.dataplane.attention.kv_quant import FP8_KV_DTYPE
    from modelfleet.dataplane.engine.model_runner import resolve_dtype
    from modelfleet.dataplane.models import load_model

    dtype = resolve_dtype("auto", torch.device(device))
    model = load_model(model_dir, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(4, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num_prompts)]
    start = time.perf_counter()
    want, tokens, amax = decode_logits(model, dtype, prompts, steps, None)
    got, _, fp8_amax = decode_logits(model, FP8_KV_DTYPE, prompts, steps, tokens)
    diff = (got - want).abs()
    result = {
        "case": "error",
        "model_dtype": str(dtype).removeprefix("torch."),
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        "decode_steps": steps,
        "max_abs_logit_diff": round(diff.max().item(), 5),
        "mean_abs_logit_diff": round(diff.mean().item(), 6),
        "max_abs_logit": round(want.abs().max().item(), 3),
        "top1_agreement": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 5),
        "positions": int(want.shape[0] * want.shape[1]),
        "kv_amax": round(amax, 3),
        "kv_amax_fp8_cache": round(fp8_amax, 3),
        "seconds": round(time.perf_counter() - start, 2),
    }
    del model
    return result


def capacity(model_dir: str, kv_cache_bytes: int, seq_len: int) -> dict:
    """What ModelRunner computes from kv_cache_bytes, for each cache dtype."""
    from modelfleet.dataplane.attention.kv_quant import FP8_KV_DTYPE
    from modelfleet.dataplane.models import ModelConfig, kv_cache_block_bytes

    config = ModelConfig.from_dir(model_dir)
    result: dict = {"case": "capacity", "kv_cache_bytes": kv_cache_bytes, "seq_len": seq_len}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_KV_DTYPE)):
        block_bytes = kv_cache_block_bytes(config, BLOCK_SIZE, dtype)
        blocks = kv_cache_bytes // block_bytes
        result[name] = {
            "block_bytes": block_bytes,
            "blocks": blocks,
            "seqs": blocks // -(-seq_len // BLOCK_SIZE),
        }
    result["seqs_ratio"] = round(result["fp8"]["seqs"] / result["bf16"]["seqs"], 3)
    return result


def engine(model_dir: str, seq_len: int, fraction: float) -> dict:
    """Blocks the engine allocates on the GPU for each cache dtype from the same memory fraction (enough
    max_num_seqs that the block count is the memory's, not the sequences' limit)."""
    from modelfleet.dataplane import LLM

    result: dict = {"case": "engine", "kv_cache_memory_fraction": fraction, "seq_len": seq_len}
    for name in ("auto", "fp8"):
        llm = LLM(
            model_dir, device="cuda", max_model_len=seq_len, max_num_seqs=8192, enforce_eager=True,
            kv_cache_memory_fraction=fraction, kv_cache_dtype=name,
        )  # fmt: skip
        runner = llm.engine.runner
        blocks = runner.num_blocks
        result[name] = {
            "dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
            "blocks": blocks,
            "gib": round(runner.kv_cache_bytes / 2**30, 3),
            "seqs": blocks // -(-seq_len // BLOCK_SIZE),
        }
        llm.engine.close()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    result["seqs_ratio"] = round(result["fp8"]["seqs"] / result["auto"]["seqs"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b")
    parser.add_argument("--model-dir", type=Path, help="a built preset (or any checkpoint) to reuse")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--kv-cache-bytes", type=int, default=16 << 30)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--memory-fraction", type=float, default=0.5)
    args = parser.parse_args(argv)
    model_dir = str(args.model_dir or Path(tempfile.mkdtemp()) / args.preset)
    if args.model_dir is None or not (Path(model_dir) / "config.json").is_file():
        build_preset(args.preset, model_dir, args.device)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    common = {"model": args.preset if args.model_dir is None else model_dir, "device": device_name}
    lines = [
        error(model_dir, args.device, args.num_prompts, args.prompt_len, args.decode_steps),
        capacity(model_dir, args.kv_cache_bytes, args.seq_len),
    ]
    for line in lines:
        print(json.dumps(common | line), flush=True)
    if args.device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps(common | engine(model_dir, args.seq_len, args.memory_fraction)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
