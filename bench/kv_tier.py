"""The host KV tier on a shared-prefix workload whose distinct prefixes are twice the KV cache.

The KV cache is sized by max_num_seqs x max_model_len (the engine keeps no more blocks than that many
sequences can fill), so that the prefixes' total is --prefix-ratio times it. Requests run in a closed loop
(--concurrency at a time); each is one of the distinct prefixes drawn at random (seeded), plus a fresh
suffix, with greedy decoding of --output-len tokens (EOS ignored). The same requests run in three cases,
one engine after the other in one process:

- tier_off: the baseline, prefixes evicted from the KV cache are recomputed;
- gpu_hits: the tier off, but a KV cache that holds every block the workload fills (max_num_seqs
  raised; the closed loop keeps --concurrency requests in flight, so batches stay as small): every
  prefix hits on the device after its first use, as in the tier-on run after its copies, with no copy;
- tier_on: the first case's KV cache and a host pool of --host-factor times it.

One JSON line per case: prefix-cache hit rate (prompt tokens found in the cache, host hits included once
copied back), the tier's hits and spills, TTFT p50/p99 and wall time (TTFT leaves out the first
--concurrency requests, which arrive together into an empty engine), and the share of requests whose
tokens equal an earlier case's (same_tokens_vs_tier_off, same_tokens_vs_gpu_hits). Greedy tokens of a
random-weight model flip on near-tied logits when a request's arithmetic changes: a prefix hit computes
only the suffix, a miss the whole prompt, and batches of other sizes change the GEMMs' rounding. So in
bf16 unequal tokens alone do not show a wrong copy. Two checks that do:

- --check-copies keeps a device-side shadow of every block spilled, taken at the same point of the
  compute stream as the spill, and compares each block loaded back, once its load has landed, bit for
  bit with the shadow of the host block it came from (copies_checked, copies_differing: 0 if every copy
  is exact, whatever the numerics);
- --dtype float32 shrinks the rounding that flips tokens: with exact copies, same_tokens_vs_gpu_hits
  and same_tokens_vs_tier_off come close to 1; a race would still corrupt whole blocks.

    python bench/kv_tier.py --device cuda --preset llama-3.2-1b --check-copies
    python bench/kv_tier.py --device cuda --preset llama-3.2-1b --check-copies --dtype float32
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
from dataclasses import dataclass

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


def engine_settings(args: argparse.Namespace, host_kv_cache_bytes: int, max_num_seqs: int) -> dict:
    return dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max_num_seqs,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        host_kv_cache_bytes=host_kv_cache_bytes,
        seed=args.seed,
    )


class CopyCheck:
    """Stands in for the tier's swapper (HostTier.swapper) and checks its copies: each spill is also
    cloned into a device-side shadow of the host pool, on the compute stream right where the spill is
    queued; each load, once the swapper reports it landed (the compute stream waits for it then), is
    compared bit for bit with the shadow of its host block. The count of differing blocks stays on the
    device until read, so checking adds no host sync to a step."""

    def __init__(self, swapper) -> None:
        self.swapper = swapper
        cache = swapper.kv_cache
        self.shadow = torch.empty(swapper.host.shape, dtype=cache.dtype, device=cache.device)
        self._bits = {2: torch.int16, 4: torch.int32}[cache.element_size()]
        self._loads: dict[str, list[tuple[int, int]]] = {}
        self.num_checked = 0
        self._num_differing = torch.zeros((), dtype=torch.int64, device=cache.device)

    @property
    def busy(self) -> bool:
        return self.swapper.busy

    def issue(self, copies) -> list[str]:
        cache = self.swapper.kv_cache
        for device_id, host_id in copies.spills:
            self.shadow[host_id].copy_(cache[:, :, device_id])
        self._loads.update(copies.loads)
        done = self.swapper.issue(copies)
        self._check(done)
        return done

    def poll(self) -> list[str]:
        done = self.swapper.poll()
        self._check(done)
        return done

    def _check(self, request_ids: list[str]) -> None:
        cache, bits = self.swapper.kv_cache, self._bits
        for request_id in request_ids:
            for device_id, host_id in self._loads.pop(request_id):
                loaded, spilled = cache[:, :, device_id].view(bits), self.shadow[host_id].view(bits)
                self._num_differing += (loaded != spilled).any()
                self.num_checked += 1

    @property
    def num_differing(self) -> int:
        return int(self._num_differing)


@dataclass
class CaseResult:
    row: dict
    tokens: list[list[int]]
    cached: list[int]  # per request, the prompt tokens found in the prefix cache


def run_case(llm, prompts: list[list[int]], args: argparse.Namespace) -> CaseResult:
    from modelfleet.dataplane import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    ttfts: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    next_index, in_flight = 0, 0
    start = time.perf_counter()
    while next_index < len(prompts) or engine.has_unfinished_requests():
        while next_index < len(prompts) and in_flight < args.concurrency:
            engine.add_request(str(next_index), prompts[next_index], params, stream=False)
            next_index, in_flight = next_index + 1, in_flight + 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                index = int(out.request_id)
                ttfts[index] = out.first_token_time - out.arrival_time
                tokens[index] = out.token_ids
                cached[index] = out.num_cached_tokens
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
    order = range(len(prompts))
    return CaseResult(row, [tokens[i] for i in order], [cached[i] for i in order])


def compare(result: CaseResult, other: CaseResult, name: str) -> dict:
    """Shares of requests with the same tokens as `other`'s: all, and those that found as many prompt
    tokens cached in both runs (the same split between tokens read from the cache and computed)."""
    pairs = list(zip(result.tokens, other.tokens, result.cached, other.cached, strict=True))
    same_hits = [(a, b) for a, b, hit_a, hit_b in pairs if hit_a == hit_b]
    return {
        f"same_tokens_vs_{name}": round(sum(a == b for a, b, _, _ in pairs) / len(pairs), 4),
        f"same_hits_vs_{name}": round(len(same_hits) / len(pairs), 4),
        f"same_tokens_of_same_hits_vs_{name}": (
            round(sum(a == b for a, b in same_hits) / len(same_hits), 4) if same_hits else None
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a checkpoint folder (else --preset or --tiny)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--tiny", action="store_true", help="the tiny demo model (CPU check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (max_num_seqs)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="with --concurrency, the KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=768)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=240)
    parser.add_argument("--prefix-ratio", type=float, default=2.0, help="distinct prefixes / KV cache")
    parser.add_argument("--host-factor", type=float, default=3.0, help="host pool / KV cache")
    parser.add_argument(
        "--check-copies", action="store_true", help="compare every block loaded back with what was spilled"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (
        args.prefix_len % args.block_size
        or args.prefix_len + args.suffix_len + args.output_len > args.max_model_len
    ):
        parser.error("--prefix-len must be whole blocks, and a request must fit --max-model-len")
    if args.host_factor <= 0:
        parser.error("--host-factor must be positive (the tier-on case needs a host pool)")

    from modelfleet.dataplane import LLM

    with tempfile.TemporaryDirectory(prefix="bench-kv-tier-") as tmp:
        if args.tiny:
            from modelfleet.dataplane.demo import create_demo_model

            model, name = str(create_demo_model(f"{tmp}/tiny", size="tiny", seed=0)), "tiny"
        elif args.preset is not None:
            model, name = build_preset(args.preset, tmp, args.device), args.preset
        else:
            model, name = args.model, args.model
        blocks_per_seq = -(-args.max_model_len // args.block_size)
        results: dict[str, CaseResult] = {}
        num_blocks = block_bytes = num_prefixes = 0
        prompts: list[list[int]] = []
        for case in ("tier_off", "gpu_hits", "tier_on"):
            max_num_seqs, host_bytes, needed_blocks = args.concurrency, 0, 0
            if case == "gpu_hits":
                # Every block the workload fills stays cached (each prefix, each request's own suffix
                # and output), with room for the requests in flight besides: nothing is evicted.
                tail_blocks = -(-(args.suffix_len + args.output_len) // args.block_size)
                needed_blocks = num_prefixes * (args.prefix_len // args.block_size)
                needed_blocks += len(prompts) * tail_blocks + args.concurrency * blocks_per_seq
                max_num_seqs = -(-needed_blocks // blocks_per_seq)
            elif case == "tier_on":  # the baseline's KV cache, and a host pool sized from it
                host_bytes = int(args.host_factor * num_blocks) * block_bytes
            llm = LLM(model, **engine_settings(args, host_bytes, max_num_seqs))
            runner = llm.engine.runner
            if case == "tier_off":
                num_blocks, block_bytes = runner.num_blocks, runner.block_bytes
                num_prefixes, prompts = workload(args, num_blocks, llm.engine.vocab_size)
            elif runner.num_blocks < needed_blocks:
                raise SystemExit(
                    f"gpu_hits: the KV cache holds {runner.num_blocks} blocks, the workload fills "
                    f"{needed_blocks}: lower --prefix-ratio, --num-requests or --concurrency"
                )
            check = None
            if args.check_copies and llm.engine.host_tier is not None:
                check = CopyCheck(llm.engine.host_tier.swapper)
                llm.engine.host_tier.swapper = check
            result = results[case] = run_case(llm, prompts, args)
            line = {
                "bench": "kv_tier",
                "case": case,
                "model": name,
                "device": args.device,
                "dtype": str(runner.dtype).removeprefix("torch."),
                "kv_cache_blocks": runner.num_blocks,
                "host_kv_blocks": host_bytes // block_bytes,
                "block_size": args.block_size,
                "num_prefixes": num_prefixes,
                "prefix_blocks": args.prefix_len // args.block_size,
                "requests": len(prompts),
                "concurrency": args.concurrency,
                **result.row,
            }
            for earlier in results:
                if earlier != case:
                    line.update(compare(result, results[earlier], earlier))
            if check is not None:
                line["copies_checked"] = check.num_checked
                line["copies_differing"] = check.num_differing
            print(json.dumps(line), flush=True)
            del llm, runner, check
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
