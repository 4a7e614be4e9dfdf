"""What admitting prompts into a running decode batch costs the engine, per step, on a GPU.

N sequences decode steadily (EOS ignored); then, for each k, every `--every`-th step admits k new
prompts of `--prompt-len` tokens (as many of the oldest sequences are aborted, so N stay running):
the steady pattern of a server whose requests arrive one by one and are held `--every - 1` pure-decode
steps. Each case
reports the wall milliseconds per step over the window (the engine launches a step before it reads the
last one's tokens, so this is the rate it sustains) and the host milliseconds spent launching the steps
that carry prompts (`launch_ms_admitting`: piecewise graphs, or the eager forward with `--engine
piecewise_graphs=false`) against those that only decode (`launch_ms_decoding`, decode graphs). k = 0 (pure
decodes) is the baseline of the same run.

    python bench/mixed_step.py --preset llama-3.2-1b --num-seqs 256 --admit 0 2 4 8 16 --every 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from throughput import build_preset


class _LaunchClock:
    """Host time of each ModelRunner.launch, split by whether the step carried prompts. With
    `drain`, each launch starts on an idle device and the time the device then takes to finish it is
    kept too (host-bound: about nothing; device-bound: most of the step)."""

    def __init__(self, runner, drain: bool) -> None:
        self.admitting: list[float] = []
        self.decoding: list[float] = []
        self.admitting_drain: list[float] = []
        self.decoding_drain: list[float] = []
        launch = runner.launch

        def timed(batch, *args, **kwargs):
            if drain:
                torch.cuda.synchronize()
            started = time.perf_counter()
            try:
                return launch(batch, *args, **kwargs)
            finally:
                launched = time.perf_counter()
                pure = all(item.num_new_tokens == 1 for item in batch.scheduled)
                (self.decoding if pure else self.admitting).append(launched - started)
                if drain:
                    torch.cuda.synchronize()
                    drained = time.perf_counter() - launched
                    (self.decoding_drain if pure else self.admitting_drain).append(drained)

        runner.launch = timed


def _median_ms(seconds: list[float]) -> float | None:
    return round(1e3 * statistics.median(seconds), 3) if seconds else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["llama-3.2-1b", "llama-3.1-8b"], default="llama-3.2-1b")
    parser.add_argument("--demo-dir", type=Path, default=Path(".modelfleet/bench"))
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--admit", type=int, nargs="+", default=[0, 2, 4, 8, 16])
    parser.add_argument("--every", type=int, default=5, help="one admitting step in this many")
    parser.add_argument("--steps", type=int, default=100, help="steps timed per case")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--drain",
        action="store_true",
        help="also time how long the device takes to finish each launch, started idle (steps then do not "
        "overlap: the per-step rate is not the engine's)",
    )
    parser.add_argument("--model", type=Path, help="a checkpoint instead of the preset (a CPU smoke run)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.drain and not cuda:
        parser.error("--drain: needs a CUDA device")
    if not cuda and args.model is None:
        raise SystemExit("error: the preset is timed on a GPU; no CUDA device here (--model for a CPU run)")

    from modelfleet.dataplane.engine.llm_engine import LLMEngine
    from modelfleet.dataplane.sampling_params import SamplingParams

    model_dir = str(args.model or build_preset(args.preset, args.demo_dir / args.preset, "cuda"))
    settings = {key: json.loads(value) for key, _, value in (p.partition("=") for p in args.engine)}
    engine = LLMEngine.from_kwargs(
        model_dir,
        max_num_seqs=args.num_seqs + max(args.admit),
        prefill_wait_steps=0,  # this bench decides when prompts come in
        **{"max_model_len": 2048, **settings},
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = _LaunchClock(engine.runner, args.drain)
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1800, ignore_eos=True, temperature=0.0, output_kind="delta")
    ids = iter(range(1 << 30))
    running: list[str] = []

    def add(n: int) -> None:
        for _ in range(n):
            request_id = f"r{next(ids)}"
            engine.add_request(request_id, rng.integers(16, vocab, size=args.prompt_len).tolist(), params)
            running.append(request_id)

    add(args.num_seqs)
    for _ in range(64):  # every prompt in, CUDA graphs warm
        engine.step()
    cases = []
    for k in args.admit:
        for _ in range(3 * args.every):  # the last case's prompts through
            engine.step()
        for kept in (clock.admitting, clock.decoding, clock.admitting_drain, clock.decoding_drain):
            kept.clear()
        sync()
        started = time.perf_counter()
        for step in range(args.steps):
            if k and step % args.every == 0:
                for request_id in running[:k]:
                    engine.abort(request_id)
                del running[:k]
                add(k)
            engine.step()
        sync()
        elapsed = time.perf_counter() - started
        cases.append(
            {
                "admitted_per_step": k,
                "ms_per_step": round(1e3 * elapsed / args.steps, 3),
                "launch_ms_admitting": _median_ms(clock.admitting),
                "launch_ms_decoding": _median_ms(clock.decoding),
                "admitting_steps": len(clock.admitting),
                **(
                    {
                        "drain_ms_admitting": _median_ms(clock.admitting_drain),
                        "drain_ms_decoding": _median_ms(clock.decoding_drain),
                    }
                    if args.drain
                    else {}
                ),
            }
        )
    pure = cases[0]["ms_per_step"] if cases[0]["admitted_per_step"] == 0 else None
    print(
        json.dumps(
            {
                "bench": "mixed_step",
                "model": str(args.model) if args.model else args.preset,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "num_seqs": args.num_seqs,
                "prompt_len": args.prompt_len,
                "every": args.every,
                "engine": settings,
                "cases": cases,
                "vs_pure_decode": [round(c["ms_per_step"] / pure, 3) for c in cases] if pure else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
