"""The host KV tier on a shared-prefix workload whose distinct prefixes are twice the KV cache.

The KV cache is sized by max_num_seqs x max_model_len (the engine keeps no more blocks than that many
sequences can fill), so that the prefixes' total is --prefix-ratio times it. Requests run in a closed loop
(--concurrency at a time); each is one of the distinct prefixes drawn at random (seeded), plus a fresh
suffix, with greedy decoding of --output-len tokens (EOS ignored). The same requests run with the tier
off (the baseline) and on (a host pool of --host-factor times the KV cache), one engine after the other
in one process. One JSON line per case: prefix-cache hit rate (prompt tokens found in the cache, host
hits included once copied back), the tier's hits and spills, TTFT p50/p99 and wall time (TTFT leaves out
the first --concurrency requests, which arrive together into an empty engine); the tier-on line also
gives the share of requests whose tokens equal the baseline's.

    python bench/kv_tier.py --device cuda --preset llama-3.2-1b
    python bench/kv_tier.py --device cpu --tiny   # the tiny demo model, a quick check of the script
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time

import numpy as np
import torch
from throughput import PRESETS, build_preset


def workload(args: argparse.Namespace, num_blocks: int, vocab: int) -> tuple[int, list[list[int]]]:
    """The number of distinct prefixes and the requests' prompts."""
    prefix_blocks = args.prefix_len // args.block_size
    num_prefixes = -(-int(args.prefix_ratio * num_blocks) // prefix_blocks)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(16, vocab) for _ in range(args.prefix_len)] for _ in range(num_prefixes)]
    prompts = [
        prefixes[rng.randrange(num_prefixes)] + [rng.randrange(16, vocab) for _ in range(args.suffix_len)]
        for _ in range(args.num_requests)
    ]
    return num_prefixes, prompts


def engine_settings(args: argparse.Namespace, host_kv_cache_bytes: int) -> dict:
    return dict(
        device=args.device,
        max_num_seqs=args.concurrency,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        host_kv_cache_bytes=host_kv_cache_bytes,
        seed=args.seed,
    )


def run_case(llm, prompts: list[list[int]], args: argparse.Namespace) -> tuple[dict, list[list[int]]]:
    from modelfleet.dataplane import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    ttfts: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    next_index, in_flight = 0, 0
    start = time.perf_counter()
    while next_index < len(prompts) or engine.has_unfinished_requests():
        while next_index < len(prompts) and in_flight < args.concurrency:
            engine.add_request(str(next_index), prompts[next_index], params, stream=False)
            next_index, in_flight = next_index + 1, in_flight + 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                ttfts[int(out.request_id)] = out.first_token_time - out.arrival_time
                tokens[int(out.request_id)] = out.token_ids
    wall = time.perf_counter() - start
    stats = engine.stats()
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    # The first wave arrives at once into an empty engine, the same in every case: left out of TTFT.
    ttft_ms = 1e3 * np.array([ttfts[i] for i in range(args.concurrency, len(prompts))])
    row = {
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "host_kv_hits": stats.host_kv_hits - before.host_kv_hits,
        "host_kv_spills": stats.host_kv_spills - before.host_kv_spills,
        "ttft_p50_ms": round(float(np.percentile(ttft_ms, 50)), 2),
        "ttft_p99_ms": round(float(np.percentile(ttft_ms, 99)), 2),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(prompts) / wall, 2),
    }
    return row, [tokens[i] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a checkpoint folder (else --preset or --tiny)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--tiny", action="store_true", help="the tiny demo model (CPU check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (max_num_seqs)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="with --concurrency, the KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=768)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=240)
    parser.add_argument("--prefix-ratio", type=float, default=2.0, help="distinct prefixes / KV cache")
    parser.add_argument("--host-factor", type=float, default=3.0, help="host pool / KV cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (
        args.prefix_len % args.block_size
        or args.prefix_len + args.suffix_len + args.output_len > args.max_model_len
    ):
        parser.error("--prefix-len must be whole blocks, and a request must fit --max-model-len")

    from modelfleet.dataplane import LLM

    with tempfile.TemporaryDirectory(prefix="bench-kv-tier-") as tmp:
        if args.tiny:
            from modelfleet.dataplane.demo import create_demo_model

            model, name = str(create_demo_model(f"{tmp}/tiny", size="tiny", seed=0)), "tiny"
        elif args.preset is not None:
            model, name = build_preset(args.preset, tmp, args.device), args.preset
        else:
            model, name = args.model, args.model
        baseline_tokens = None
        num_blocks = block_bytes = 0
        for case, host_factor in (("tier_off", 0.0), ("tier_on", args.host_factor)):
            # The tier-on engine gets the same KV cache (capped by concurrency x max_model_len) and a host
            # pool sized from it.
            host_bytes = int(host_factor * num_blocks) * block_bytes if host_factor else 0
            llm = LLM(model, **engine_settings(args, host_bytes))
            runner = llm.engine.runner
            num_blocks, block_bytes = runner.num_blocks, runner.block_bytes
            num_prefixes, prompts = workload(args, num_blocks, llm.engine.vocab_size)
            row, tokens = run_case(llm, prompts, args)
            line = {
                "bench": "kv_tier",
                "case": case,
                "model": name,
                "device": args.device,
                "kv_cache_blocks": num_blocks,
                "host_kv_blocks": host_bytes // block_bytes,
                "block_size": args.block_size,
                "num_prefixes": num_prefixes,
                "prefix_blocks": args.prefix_len // args.block_size,
                "requests": len(prompts),
                "concurrency": args.concurrency,
                **row,
            }
            if baseline_tokens is None:
                baseline_tokens = tokens
            else:
                same = sum(a == b for a, b in zip(tokens, baseline_tokens, strict=True))
                line["same_tokens_as_tier_off"] = round(same / len(tokens), 4)
            print(json.dumps(line), flush=True)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
