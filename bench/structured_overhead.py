"""Structured output's cost per decode step on the host, against plain decoding of the same prompts.

A demo model (the tiny one by default) on the CPU, N sequences in steady decode, first plain (EOS
ignored), then constrained by bench/serve.py's long JSON schema (no answer ends within the run, so every
step masks every row). Prints one JSON line per mode with the median wall and thread-CPU milliseconds of
a whole `LLMEngine.step()` and of its structured part: the time spent in the sampler's grammar call
(`GrammarMasks.apply`: advancing the matchers, filling, copying and applying the bitmask) and in any
`GrammarMatcher.accept_token` made outside it.

    python bench/structured_overhead.py --num-seqs 64 --steps 100

On the CPU the model runs on the same host, so what this shows is the host time of the structured
parts; the overlap of that work with the device's step shows only on a GPU (bench/serve.py --structured).

Measured on the shared 2-core development machine (tiny demo, 64 sequences, 100 steps, medians; before
and after run alternately, three times each): a plain step 3.10-3.35 ms; a constrained one 3.73-4.74 ms
before (engine at 6ac2a46: per-row fills, matchers advanced in LLMEngine._process, a step's previous
tokens read before the launch) with 0.46-0.49 ms in the structured parts, and 3.74-4.40 ms after with
0.44-0.51 ms. The host time is the same: xgrammar's fill itself (about 0.24 ms for 64 rows here) is
most of it, the matchers' accept_token about 0.14 ms and the CPU masking about 0.11 ms. What changed
shows on a GPU only: before, the device sat idle while the host processed a step's tokens before the
next launch, and the bitmask's blocking copy waited for the forward; now the host does all of it while
the device computes the next forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from serve import LONG_SCHEMA


class StructuredTimer:
    """Accumulates the time spent in the structured entry points while installed."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self._depth = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self._depth:  # nested: the outer call counts it already
                return fn(*args, **kwargs)
            self._depth += 1
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu
                self._depth -= 1

        return timed

    def take(self) -> tuple[float, float]:
        taken = (self.wall, self.cpu)
        self.wall = self.cpu = 0.0
        return taken


def install(timer: StructuredTimer) -> None:
    import xgrammar
    from modelfleet.dataplane.engine.structured import GrammarMasks

    GrammarMasks.apply = timer.wrap(GrammarMasks.apply)
    xgrammar.GrammarMatcher.accept_token = timer.wrap(xgrammar.GrammarMatcher.accept_token)


def run_mode(engine, timer: StructuredTimer, mode: str, args, vocab: int) -> dict:
    from modelfleet.dataplane.sampling_params import SamplingParams

    max_tokens = args.warmup + args.steps + 8
    if mode == "plain":
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind="delta")
    else:
        structured = ("json_schema", json.dumps(LONG_SCHEMA))
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, structured=structured, output_kind="delta"
        )
    rng = np.random.default_rng(1)
    for i in range(args.num_seqs):
        prompt = rng.integers(16, vocab, size=args.prompt_len).tolist()
        engine.add_request(f"{mode}-{i}", prompt, params)
    # Prefill (and the grammar's compile) until every sequence decodes, then warm up.
    while (
        engine._compiling
        or engine.scheduler.waiting
        or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running)
    ):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    timer.take()
    samples = []
    for _ in range(args.steps):
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        samples.append((wall, cpu, *timer.take()))
    assert len(engine.scheduler.running) == args.num_seqs, "a sequence finished early"
    for i in range(args.num_seqs):
        engine.abort(f"{mode}-{i}")
    while engine.has_unfinished_requests() or engine._launched is not None:
        engine.step()
    keys = ("step_wall", "step_cpu", "structured_wall", "structured_cpu")
    medians = {
        f"{k}_ms": round(statistics.median(s[j] for s in samples) * 1e3, 3) for j, k in enumerate(keys)
    }
    return {
        "bench": "structured_overhead",
        "mode": mode,
        "num_seqs": args.num_seqs,
        "steps": args.steps,
        **medians,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint; default: the tiny demo")
    args = parser.parse_args()

    from modelfleet.dataplane.demo import create_demo_model
    from modelfleet.dataplane.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    timer = StructuredTimer()
    install(timer)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or create_demo_model(Path(tmp) / "tiny", size="tiny")
        engine = LLMEngine.from_kwargs(
            str(model_dir),
            device="cpu",
            dtype="float32",
            max_num_seqs=args.num_seqs,
            max_num_batched_tokens=max(2048, args.num_seqs * args.prompt_len),
            max_model_len=1024,
        )
        vocab = engine.model_config.vocab_size
        for mode in ("plain", "json_schema"):
            print(json.dumps(run_mode(engine, timer, mode, args, vocab)), flush=True)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
