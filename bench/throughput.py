"""Offline throughput: our engine against Hugging Face `generate` on the same random-token prompts.

Modelled on vLLM's offline throughput benchmark. EOS is ignored, so every request produces exactly its
output length. The baseline runs `generate` on padded batches, each until its longest output; both
sides are credited with the same tokens (each prompt's own input and output length). Prints one JSON
line with tokens/s of both and the ratio.

    python bench/throughput.py --model DIR --num-prompts 64 --input-len 512 --min-input-len 16 \\
        --output-len 256 --min-output-len 16
    python bench/throughput.py --model DIR --num-prompts 64 --input-len 128 --output-len 128

Lengths: fixed by default; uniform in [min, len] with --min-*-len, or in [len*(1-r), len*(1+r)] with
--random-range-ratio r (vLLM's convention).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch


def sample_lengths(
    rng: np.random.Generator, n: int, length: int, minimum: int | None, ratio: float
) -> list[int]:
    if minimum is not None:
        low, high = minimum, length
    else:
        low, high = max(int(length * (1 - ratio)), 1), int(length * (1 + ratio))
    return rng.integers(low, high + 1, size=n).tolist()


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    input_lens = sample_lengths(
        rng, args.num_prompts, args.input_len, args.min_input_len, args.random_range_ratio
    )
    output_lens = sample_lengths(
        rng, args.num_prompts, args.output_len, args.min_output_len, args.random_range_ratio
    )
    # Low ids are the tokenizer's special tokens; random text tokens come from above them.
    return [
        (rng.integers(16, vocab_size, size=n_in).tolist(), n_out)
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def run_engine(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> float:
    from modelfleet.dataplane import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_caching=False,
        seed=args.seed,
    )
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n) for _, n in requests]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [n for _, n in requests]
    return elapsed


def run_hf(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> float:
    from modelfleet.dataplane.engine.model_runner import resolve_dtype
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.generation_config.eos_token_id = None
    pad_id = model.config.pad_token_id or 0
    with torch.inference_mode():
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=True, pad_token_id=pad_id)
    start = time.perf_counter()
    for i in range(0, len(requests), args.hf_batch_size):
        batch = requests[i : i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                top_k=0,
                max_new_tokens=max(n for _, n in batch),
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def rates(elapsed: float, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    num_out = sum(n for _, n in requests)
    num_total = num_out + sum(len(p) for p, _ in requests)
    return {
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "total_tokens_per_s": round(num_total / elapsed, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-input-len", type=int, default=None)
    parser.add_argument("--min-output-len", type=int, default=None)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for both (default: the engine's choice, used by both)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="time our engine only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model):
        print(
            f"--model: {args.model} is not a directory; make one with `modelfleet demo create DIR`",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        # The engine takes its thread count from this variable at start; the baseline from torch.
        os.environ["MODELFLEET_CPU_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    with open(os.path.join(args.model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    requests = make_requests(args, vocab_size)
    result: dict = {
        "benchmark": "throughput",
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(n for _, n in requests),
        "input_len_range": [min(len(p) for p, _ in requests), max(len(p) for p, _ in requests)],
        "output_len_range": [min(n for _, n in requests), max(n for _, n in requests)],
        "dtype": args.dtype,
        "hf_batch_size": args.hf_batch_size,
    }
    result["engine"] = rates(run_engine(args, requests), requests)
    # The baseline runs with the thread count the engine chose (or was given).
    result["threads"] = torch.get_num_threads()
    if not args.skip_hf:
        result["hf"] = rates(run_hf(args, requests), requests)
        result["ratio_output_tokens_per_s"] = round(
            result["engine"]["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"], 2
        )
        result["ratio_total_tokens_per_s"] = round(
            result["engine"]["total_tokens_per_s"] / result["hf"]["total_tokens_per_s"], 2
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
