"""The engine's host (Python) time per decode step, with the model call and the sampler left out.

A tiny demo model, N sequences in steady decode (EOS ignored, prompts long enough, no stop strings).
The model runner's forward and sampler are replaced by stand-ins that return at once (random next
tokens from numpy), so what is timed is only what the host does around them every step:

- schedule: `Scheduler.schedule`
- prepare: the model runner building the step's input arrays (from `launch` entry to the forward)
- post: everything after the sampled tokens are known until `step` returns (scheduler update,
  detokenization, stop checks, the per-request outputs)

Prints one JSON line with the median milliseconds of each per step (wall and thread CPU), and, with
--profile, the total CPU time per step under cProfile and its top functions on stderr.

    python bench/step_overhead.py --num-seqs 256 --steps 200
    python bench/step_overhead.py --num-seqs 256 --steps 200 --relayed

--relayed: the requests as an engine process runs streams that a relay writes (delta outputs; after
the first, each goes through engine_process.OutputRoutes to a relay's pipe, read by a process that
drops it), twice in one run: the text decoded in the engine (the baseline), then handed to the relay
(`release_text`: outputs carry tokens alone). Each line's `route` is OutputRoutes.send (rows, pickling,
the pipe write), `host` the engine process's whole host time per step (total plus route).

Measured on the shared 2-core development machine (tiny model, 256 sequences, 200 steps; medians of
wall ms per step; runs of the same code vary by up to 1.5x with the machine's load, so before and after
were run alternately, twice each):
    before (engine at 5d0d020, streamed): schedule 0.46-0.70, prepare 0.35-0.53, post 3.3-4.9,
        total 4.1-6.0; cProfile 14.6-15.8 CPU ms per step
    after, streamed (AsyncLLM, the server): schedule 0.21-0.33, prepare 0.28-0.30, post 2.0-2.2,
        total 2.5-2.9; cProfile 9.4
    after, --no-stream (LLM.generate): schedule 0.31-0.33, prepare 0.22-0.26, post 0.19-0.20,
        total 0.74-0.81; cProfile 3.4-3.8
Long streams (`--num-seqs 256 --warmup 1000 --steps 100`, about 1,000 output tokens each, alternately,
twice each): `--output-kind cumulative` total 7.2-13.8 ms per step, of which post 5.9-12.0, and 1.49 MB
of pickled outputs per step; `--output-kind delta` (what the server asks for) total 3.0-5.0, post 2.0-3.3,
24 KB.
cProfile's figure includes its own overhead per Python call (about 3x here), so it overstates the
absolute time; the ratio between runs is what it shows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing
import pickle
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build_engine(model_dir: Path, num_seqs: int):
    from modelfleet.dataplane.engine.llm_engine import LLMEngine

    return LLMEngine.from_kwargs(
        str(model_dir),
        device="cpu",
        dtype="float32",
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, num_seqs * 16),
        enable_prefix_caching=True,
    )


class _Timed:
    """Replaces the model call and the sampler with stand-ins and stamps when each phase ends."""

    def __init__(self, engine, vocab: int, seed: int) -> None:
        from modelfleet.dataplane.engine.model_runner import StepResult

        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        runner = engine.runner
        scheduler = engine.scheduler
        self.marks: dict[str, float] = {}
        hidden = torch.zeros(engine.config.max_num_seqs, engine.model_config.hidden_size)
        schedule = scheduler.schedule
        launch = runner.launch

        def timed_schedule():
            out = schedule()
            self.marks["scheduled"] = _now()
            return out

        def fake_forward(*args, **kwargs):
            self.marks["prepared"] = _now()
            return hidden

        def fake_sample(out, hidden_states, cu_query):
            n = len(out.scheduled)
            tokens = [
                int(t) if s.samples else None for t, s in zip(self.next_tokens(n), out.scheduled, strict=True)
            ]
            return _Launched(StepResult(tokens, [None] * n, [None] * n))

        def timed_launch(out, end_previous=None):
            launched = launch(out, end_previous)
            self.marks["sampled"] = _now()
            return launched

        scheduler.schedule = timed_schedule
        runner.decode_graphs = None
        runner._forward_eager = fake_forward
        runner._sample = fake_sample
        runner.launch = timed_launch

    def next_tokens(self, n: int) -> np.ndarray:
        # Ordinary ids (no special tokens at the low end), so detokenization does real work.
        return self.rng.integers(16, self.vocab, size=n)

    def step(self) -> dict[str, float]:
        start = _now()
        self.outputs = self.engine.step()
        end = _now()
        m = self.marks
        times = {}
        for clock in (0, 1):
            name = ("wall", "cpu")[clock]
            times[f"schedule_{name}"] = m["scheduled"][clock] - start[clock]
            times[f"prepare_{name}"] = m["prepared"][clock] - m["scheduled"][clock]
            times[f"post_{name}"] = end[clock] - m["sampled"][clock]
            times[f"total_{name}"] = (end[clock] - start[clock]) - (
                m["sampled"][clock] - m["prepared"][clock]
            )
        return times


class _Launched:
    """A stand-in for a launched step whose tokens are already known."""

    def __init__(self, result) -> None:
        self._result = result

    def finish(self) -> None:
        pass  # no grammar fill to wait for

    def result(self):
        return self._result


def _drain(*conns) -> None:
    """A stand-in relay and server: reads every message, drops it, until the pipes close."""
    from multiprocessing.connection import wait

    open_conns = list(conns)
    while open_conns:
        for conn in wait(open_conns):
            try:
                conn.recv()
            except EOFError:
                open_conns.remove(conn)


def relayed_run(engine, timed: _Timed, args, vocab: int, text_in: str) -> dict[str, float]:
    """Median ms per step of streams routed to a relay, their text decoded `text_in` the engine or
    the relay."""
    from modelfleet.dataplane.engine.engine_process import OutputRoutes
    from modelfleet.dataplane.sampling_params import SamplingParams

    context = multiprocessing.get_context("spawn")
    from_engine, to_relay = context.Pipe(duplex=False)
    from_server_end, to_server = context.Pipe(duplex=False)
    drain = context.Process(target=_drain, args=(from_engine, from_server_end), daemon=True)
    drain.start()
    from_engine.close()
    from_server_end.close()
    routes = OutputRoutes(to_server, [to_relay])
    if text_in == "relay":
        routes.share_tokenizer(engine.stream_tokenizer(), engine.release_text)
        assert routes.text_in_relays, "this tokenizer's text cannot be decoded in a relay"
    params = SamplingParams(
        max_tokens=args.warmup + args.steps + 8, ignore_eos=True, temperature=0.0, output_kind="delta"
    )
    rng = np.random.default_rng(1)
    ids = [f"{text_in}-{i}" for i in range(args.num_seqs)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(16, vocab, size=args.prompt_len).tolist(), params)
        routes.add(request_id, 1)

    def step() -> dict[str, float]:
        times = timed.step()
        start = _now()
        routes.send(timed.outputs, engine.stats())
        end = _now()
        for clock, name in enumerate(("wall", "cpu")):
            times[f"route_{name}"] = end[clock] - start[clock]
            times[f"host_{name}"] = times[f"total_{name}"] + times[f"route_{name}"]
        return times

    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running
    ):
        step()
    for _ in range(args.warmup):
        step()
    samples = [step() for _ in range(args.steps)]
    assert len(engine.scheduler.running) == args.num_seqs, "a sequence finished early"
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        step()
    to_relay.close()
    to_server.close()
    drain.join(timeout=30)
    return {f"{key}_ms": round(statistics.median(s[key] for s in samples) * 1e3, 3) for key in samples[0]}


def _now() -> tuple[float, float]:
    # Wall time, and this thread's CPU time: on a shared machine the second is the steadier figure.
    return time.perf_counter(), time.thread_time()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="requests as LLM.generate adds them: no outputs before they finish (default: streamed)",
    )
    parser.add_argument(
        "--output-kind",
        choices=["cumulative", "delta"],
        default="cumulative",
        help="what each streamed output carries: everything so far, or only what is new (the server)",
    )
    parser.add_argument("--profile", action="store_true", help="also run the steps under cProfile")
    parser.add_argument(
        "--relayed",
        action="store_true",
        help="streams a relay writes: the text decoded in the engine, then in the relay (one line)",
    )
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint; default: the tiny demo")
    args = parser.parse_args()

    from modelfleet.dataplane.demo import create_demo_model
    from modelfleet.dataplane.sampling_params import SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or create_demo_model(Path(tmp) / "tiny", size="tiny")
        engine = build_engine(model_dir, args.num_seqs)
        vocab = engine.model_config.vocab_size
        timed = _Timed(engine, vocab, seed=0)
        if args.relayed:
            runs = {
                text_in: relayed_run(engine, timed, args, vocab, text_in) for text_in in ("engine", "relay")
            }
            result = {
                "bench": "step_overhead",
                "relayed": True,
                "num_seqs": args.num_seqs,
                "steps": args.steps,
                "text_in_engine": runs["engine"],
                "text_in_relay": runs["relay"],
                "host_cpu_ratio": round(runs["relay"]["host_cpu_ms"] / runs["engine"]["host_cpu_ms"], 3),
            }
            print(json.dumps(result))
            return 0
        max_tokens = args.warmup + args.steps * (2 if args.profile else 1) + 8
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=args.output_kind
        )
        rng = np.random.default_rng(1)
        for i in range(args.num_seqs):
            prompt = rng.integers(16, vocab, size=args.prompt_len).tolist()
            if args.no_stream:
                engine.add_request(f"r{i}", prompt, params, stream=False)
            else:
                engine.add_request(f"r{i}", prompt, params)
        # Prefill until every sequence decodes, then warm up.
        while engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running
        ):
            timed.step()
        for _ in range(args.warmup):
            timed.step()
        samples = [timed.step() for _ in range(args.steps)]
        assert len(engine.scheduler.running) == args.num_seqs, "a sequence finished early"
        result = {
            "bench": "step_overhead",
            "num_seqs": args.num_seqs,
            "stream": not args.no_stream,
            "output_kind": args.output_kind,
            "output_tokens_at_start": args.warmup,
            "steps": args.steps,
            # what an engine process sends its server for one step
            "pickled_step_outputs_bytes": len(pickle.dumps(timed.outputs, protocol=pickle.HIGHEST_PROTOCOL)),
            **{f"{key}_ms": round(statistics.median(s[key] for s in samples) * 1e3, 3) for key in samples[0]},
        }
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                timed.step()
            profiler.disable()
            stats = pstats.Stats(profiler, stream=io.StringIO())
            result["profile_cpu_ms_per_step"] = round(stats.total_tt / args.steps * 1e3, 3)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue(), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
