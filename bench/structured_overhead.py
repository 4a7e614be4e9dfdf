"""Structured output's cost per decode step on the host, against plain decoding of the same prompts.

A demo model (the tiny one by default) on the CPU or a GPU, N sequences in steady decode, first plain
(EOS ignored), then constrained by one of bench/serve.py's JSON schemas (--schema; no answer ends within
the run, so every step masks every row): json_schema_serial with the grammar fill on the engine thread
(Sampler.begin(overlap=False), as before the fill overlapped), json_schema as the engine runs it.
Prints one JSON line per mode with the median and mean wall (and thread-CPU) milliseconds of a whole
`LLMEngine.step()`, timed over --steps with nothing timed inside it, then, over --steps more (whose
steps, timers included, are `step_wall_timed`: each accept's timer is a Python call), of its structured
part: the time in the sampler's grammar calls on the engine
thread (`GrammarMasks.begin` and its finish) and in any `GrammarMatcher.accept_token` outside them, then
that part's pieces: `wait` (reading back the previous step's tokens: the device's time), `accept` (the
matchers' accepts, each call timed), `follow` (the matchers brought up to their tokens, `wait` and
the accepts included, timed once a step), `fill_wait` (finish's wait for a fill still running on the
worker), `mask` (the masking, queued on a GPU), and `structured_host` (the structured part less its
waits); and `fill` (xgrammar's batched bitmask fill, on whichever thread), `fill_hidden` (the fill less
fill_wait: its time off the engine thread's path), `process` (LLMEngine._process, which the fill
overlaps).

    python bench/structured_overhead.py --num-seqs 64 --steps 100
    python bench/structured_overhead.py --vocab 128256 --num-seqs 64 --steps 60   # /tmp/m1b's vocabulary
    python bench/structured_overhead.py --vocab 128256 --device cuda --num-seqs 64 --steps 200
    python bench/structured_overhead.py --vocab 128256 --bpe --schema records --device cuda --steps 200
    python bench/structured_overhead.py --model DIR --device cuda --schema records --trace traces/

--trace DIR: after each mode's timed steps, a torch profiler trace (Chrome's format) of --trace-steps more,
the engine's phases named (schedule, launch, launch_sample, finish_launched, process, and a constrained
step's parts) while it traces: a gap in the GPU's kernels shows which host work it waited for.

--vocab N: the tiny model's layers with the demo tokenizer (~2.2k tokens) padded to N ids, eos at N-255:
the vocabulary of bench/throughput.py's presets as bench/serve.py serves them with the demo tokenizer.

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

With a 128256-id vocabulary around the 2.2k-token demo tokenizer (--vocab 128256, 64 sequences, 60
steps, means of 4 runs each, before and after alternating, the machine loaded by others so wall times
are loose), the grammar once worked in all 128256 ids, and xgrammar handles each id without text as a
special token in every fill and accept: accept_token 34 us instead of 1 us, up to ~150 us more per row
in a fill. Before (the grammar over the model's ids): structured part 49-86 ms a step (thread-CPU
41-43 ms), of it accept 2.0-3.6 ms, fill 9.6-16.9 ms and the CPU masking of 128k columns 37-64 ms
(xgrammar's CPU kernel; a Triton kernel on a GPU). After (the tokenizer's ids and the far eos, the
padded ids masked apart): 7.5-14.4 ms (thread-CPU 7.4-8.4 ms), of it accept 0.27-0.6 ms, fill 3.3-5.8
ms, masking 3.7-7.7 ms. The fill left is xgrammar's own cost in this schema's maxLength-12 strings
(100-180 us a row a few characters in, 1 us without maxLength; every row at once here since the random
model repeats one string); xgrammar's threads share it (MODELFLEET_GRAMMAR_THREADS, half the cores).

The fill on a worker thread (--vocab 128256 --bpe, serve.py's byte-level BPE tokenizer of 122.6k ids,
64 sequences, 40-60 steps, medians; the 2-core machine loaded by other jobs at 2-4, so wall times are
loose): long schema, fill 8.1-11.3 ms a step on xgrammar's one thread here; serial, all of it on the
engine thread (structured_host 39-42 ms, of it the CPU masking of 128k columns 30 ms, a GPU kernel
elsewhere); overlapped, structured_host 35-36 ms, fill_wait 4.2-6.6 ms, 4.2-5.2 ms of the fill off the
engine thread's path (process 0.45 ms; the rest the bench loop, the admission and the schedule, here
slowed by the load). Records schema: fill 0.26-0.38 ms, all of it hidden (fill_wait under 0.01 ms). The
CPU's step wall times do not show the gain: the forward runs on the host, and the machine's two cores
are shared by the worker, xgrammar's thread and the other jobs; on a GPU the host's step is the step.

On an H200 with the 1B preset (--model, the checkpoint bench/serve.py --structured builds; 64 rows,
records; medians): a traced constrained step spent ~1 ms of host time on the logits, the sampler and the
bitmask's bookkeeping, run eagerly after the forward's graph (plain steps replay them inside it): plain
1.18 ms, JSON schema 3.32 ms a step. With the masked sampling head's own graph (MaskedHeadGraphs), in
another call: plain 1.30 ms, JSON schema 1.72 ms, json_schema_serial 2.45 ms. There `accept` reads ~0.2
ms, but the timer wrapped around each accept is most of it (64 bare accepts take ~25 us on the 2-core
machine), and `fill` (~0.8-1.2 ms) counts the worker's wait for the interpreter lock after the fill.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from serve import SCHEMAS, with_bpe_tokenizer

MODES = ("plain", "json_schema_serial", "json_schema")


class PartTimer:
    """Accumulates, per name, the time spent in the functions installed under it; a call nested in
    another of the same name counts once. A part given `within` counts only inside that part."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._depth: dict[str, int] = {}

    def wrap(self, fn, name: str, within: str | None = None):
        self.wall.setdefault(name, 0.0)
        self.cpu.setdefault(name, 0.0)

        def timed(*args, **kwargs):
            if self._depth.get(name) or (within is not None and not self._depth.get(within)):
                return fn(*args, **kwargs)
            self._depth[name] = 1
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.thread_time() - cpu
                self._depth[name] = 0

        return timed

    def take(self) -> dict[str, float]:
        """Wall seconds per part since the last take (and "structured_cpu": its thread time)."""
        taken = {**self.wall, "structured_cpu": self.cpu.get("structured", 0.0)}
        self.wall = dict.fromkeys(self.wall, 0.0)
        self.cpu = dict.fromkeys(self.cpu, 0.0)
        return taken


@contextlib.contextmanager
def patched(wrappers: list[tuple[object, str, Callable]]) -> Iterator[None]:
    """Each (owner, attribute, wrap): the attribute replaced by wrap(attribute) while inside, restored on
    exit, so that nothing measured outside pays for the wrappers."""
    originals = [(owner, attr, vars(owner)[attr]) for owner, attr, _ in wrappers]
    for owner, attr, wrap in wrappers:
        setattr(owner, attr, wrap(getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)


def timed_parts(timer: PartTimer) -> contextlib.AbstractContextManager[None]:
    """structured: the sampler's grammar calls on the engine thread (`GrammarMasks.begin` and a finish)
    and any accept_token outside them; within them, wait: reading back the previous step's tokens (the
    device's time, not the host's), accept: the matchers' accepts (the one native call for all rows and
    any single accept_token of a row behind; each call timed, so the timer's own cost counts in it),
    follow: the whole of bringing the matchers up to their tokens (one timing a step: the accepts, their
    bookkeeping and `wait`), fill_wait: finish's wait for a fill still running on the worker thread, mask:
    queuing (on a GPU) or running (on the CPU) the masking, the padded ids' included. fill: xgrammar's
    bitmask fill, on whichever thread runs it (the worker's, unless serial). process: LLMEngine._process,
    the previous step's tokens into outputs (the work a fill on the worker overlaps). The step's phases
    (schedule, launch, finish_launched: within launch where the runner ends the step before once the
    next forward is queued, ModelRunner.launch) and, on a GPU, the graph path's parts: graphs_run (the forward
    graph), head_run (a constrained step's head graph: its inputs, the bitmask filled into them, their
    one copy and the replay), graph_sampled (the tokens' read-back queued), fill_start (handing the
    fill to the worker thread). With the grammars in a process of their own (a GPU's default,
    engine/grammar_process.py): grammar_send (a step's tokens sent there) and grammar_reply (waiting for
    the rows it filled), both within structured. The functions are restored on exit: the timers' own
    cost (a timed call per accept) stays out of the step times measured without them."""
    import xgrammar
    from modelfleet.dataplane.engine import structured
    from modelfleet.dataplane.engine.grammar_process import GrammarProcess
    from modelfleet.dataplane.engine.sampler import SampledBatch

    def part(name: str, within: str | None = None) -> Callable:
        return lambda fn: timer.wrap(fn, name, within)

    def accept(fn: Callable) -> Callable:  # an accept outside begin counts as structured time too
        return timer.wrap(timer.wrap(fn, "accept"), "structured")

    masks = structured.GrammarMasks
    return patched(
        [
            *((owner, attribute, part(name)) for owner, attribute, name in step_phases()),
            *((masks, name, part("structured")) for name in ("begin", "finish", "finish_bitmask", "wait")),
            (xgrammar.GrammarMatcher, "accept_token", accept),
            (structured, "_accept_tokens", accept),
            (structured, "_follow_tokens", part("follow", "structured")),
            (SampledBatch, "host_token_ids", part("wait", "structured")),
            (structured._FillWorker, "wait", part("fill_wait", "structured")),
            (GrammarProcess, "start", part("grammar_send", "structured")),
            (GrammarProcess, "_reply", part("grammar_reply", "structured")),
            (xgrammar.BatchGrammarMatcher, "batch_fill_next_token_bitmask", part("fill")),
            (xgrammar, "apply_token_bitmask_inplace", part("mask")),
            (structured._PaddingMask, "apply", part("mask")),
        ]
    )


def step_phases() -> list[tuple[object, str, str]]:
    """An engine step's phases and a GPU's graph path's parts (a constrained row's head graph runs after
    the fill), as (owner, attribute, name): timed by timed_parts, named in traces by labelled_phases."""
    from modelfleet.dataplane.engine import structured
    from modelfleet.dataplane.engine.llm_engine import LLMEngine
    from modelfleet.dataplane.engine.model_runner import ModelRunner
    from modelfleet.dataplane.engine.sampler import Sampler
    from modelfleet.dataplane.engine.scheduler import Scheduler
    from modelfleet.dataplane.kernels.cuda_graphs import DecodeGraphRunner, MaskedHeadGraphs

    return [
        (LLMEngine, "_process", "process"),
        (LLMEngine, "_finish_launched", "finish_launched"),
        (Scheduler, "schedule", "schedule"),
        (ModelRunner, "launch", "launch"),
        (DecodeGraphRunner, "run", "graphs_run"),
        (MaskedHeadGraphs, "run", "head_run"),
        (Sampler, "graph_sampled", "graph_sampled"),
        (structured._FillWorker, "start", "fill_start"),
    ]


def labelled_phases() -> contextlib.AbstractContextManager[None]:
    """Names the engine's host phases in a profiler trace (record_function ranges), while inside."""
    from modelfleet.dataplane.engine import structured
    from modelfleet.dataplane.engine.model_runner import ModelRunner
    from modelfleet.dataplane.engine.sampler import Sampler

    def label(name: str) -> Callable:
        def wrap(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def run(*args, **kwargs):
                with torch.profiler.record_function(name):
                    return fn(*args, **kwargs)

            return run

        return wrap

    return patched(
        [
            *((owner, attribute, label(name)) for owner, attribute, name in step_phases()),
            (ModelRunner, "_sample", label("launch_sample")),
            # a constrained step's parts
            (Sampler, "begin_masks", label("begin_masks")),
            (Sampler, "fused_parameters", label("fused_parameters")),
            (structured, "_follow_tokens", label("follow")),
            (structured._FillWorker, "wait", label("fill_wait")),
        ]
    )


def padded_demo_model(out_dir: Path, vocab_size: int, tokenizer_vocab: int | None = None) -> Path:
    """The tiny demo model's layers around the demo tokenizer trained for `tokenizer_vocab` ids (default
    `vocab_size`; the corpus yields ~2.2k), its vocabulary padded to `vocab_size` rows with bos/eos at
    vocab_size - 256/255: the shape of bench/throughput.py's presets with the demo tokenizer (128256
    ids, eos 128001, as Llama 3)."""
    from modelfleet.dataplane.demo import tokenizer as demo_tokenizer
    from modelfleet.dataplane.demo.model import SIZES, llama_config, random_weights
    from safetensors.torch import save_file

    tokenizer = demo_tokenizer.train_tokenizer(out_dir, tokenizer_vocab or vocab_size)
    if tokenizer.get_vocab_size() + 256 > vocab_size:
        raise ValueError(f"--vocab {vocab_size}: leaves no padded ids past the ~2.2k-token tokenizer")
    bos, eos = vocab_size - 256, vocab_size - 255
    size = SIZES["tiny"]
    names = (demo_tokenizer.BOS, demo_tokenizer.EOS, demo_tokenizer.IM_END, demo_tokenizer.PAD)
    config = llama_config(size, vocab_size, dict.fromkeys(names, eos))
    config.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_weights(size, vocab_size, seed=0), str(out_dir / "model.safetensors"))
    return out_dir


def trace_steps(engine, path: Path, steps: int) -> None:
    """A torch profiler trace (Chrome's format) of `steps` more steps: the host's calls beside the
    device's kernels, where a gap on the device shows which host work it waited for."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    path.parent.mkdir(parents=True, exist_ok=True)
    with labelled_phases(), profile(activities=activities, with_stack=False) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("LLMEngine.step"):
                engine.step()
    prof.export_chrome_trace(str(path))


def run_mode(engine, timer: PartTimer, mode: str, args, vocab: int) -> dict:
    from modelfleet.dataplane.sampling_params import SamplingParams

    max_tokens = args.warmup + 2 * args.steps + (args.trace_steps if args.trace else 0) + 8
    sampler = engine.runner.sampler
    # Serial: the fill on the engine thread, as before it overlapped the previous step's processing.
    overlap = mode != "json_schema_serial"
    sampler.begin = functools.partial(type(sampler).begin, sampler, overlap=overlap)
    sampler.begin_masks = functools.partial(type(sampler).begin_masks, sampler, overlap=overlap)
    if mode == "plain":
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind="delta")
    else:
        structured = ("json_schema", json.dumps(SCHEMAS[args.schema]))
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
    # The step's own time first, with nothing timed inside it; then its parts, each timed.
    clean = []
    for _ in range(args.steps):
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        clean.append({"step_wall": time.perf_counter() - wall, "step_cpu": time.thread_time() - cpu})
    samples = []
    with timed_parts(timer):
        timer.take()
        for _ in range(args.steps):
            wall = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - wall
            parts = timer.take()
            # The host's own structured time: the grammar calls less their waits for the device's
            # tokens and for the fill on the worker (its share still on the engine thread's path is
            # fill_wait).
            parts["structured_host"] = parts["structured"] - parts["wait"] - parts["fill_wait"]
            # The fill's time off the engine thread's path (none when serial).
            parts["fill_hidden"] = parts["fill"] - parts["fill_wait"] if mode == "json_schema" else 0.0
            samples.append({"step_wall_timed": wall, **parts})
    if args.trace is not None:
        trace_steps(engine, args.trace / f"structured-overhead-{mode}.json", args.trace_steps)
    assert len(engine.scheduler.running) == args.num_seqs, "a sequence finished early"
    for i in range(args.num_seqs):
        engine.abort(f"{mode}-{i}")
    while engine.has_unfinished_requests() or engine._launched is not None:
        engine.step()
    # Medians resist the other processes of a shared machine; means count the costly steps of a
    # grammar (1 in 4 here) that a median hides, and make the throughput.
    names = {"structured": "structured_wall"}
    medians = {}
    for key in [*clean[0], *samples[0]]:
        values = [s[key] * 1e3 for s in (clean if key in clean[0] else samples)]
        medians[f"{names.get(key, key)}_ms"] = round(statistics.median(values), 3)
        medians[f"{names.get(key, key)}_mean_ms"] = round(statistics.fmean(values), 3)
    return {
        "bench": "structured_overhead",
        "mode": mode,
        "device": args.device,
        "model_vocab": vocab,
        "schema": args.schema,
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
    parser.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="instead of --model: the tiny demo's layers, its tokenizer padded to this many ids (128256: "
        "bench/throughput.py's presets with the demo tokenizer)",
    )
    parser.add_argument(
        "--bpe",
        action="store_true",
        help="with --vocab: a byte-level BPE tokenizer of about that many ids instead (bench/serve.py's "
        "--structured presets; trained once, in a -bpe sibling of the model's folder)",
    )
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="long", help="bench/serve.py's schemas")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on a GPU")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="json_schema_serial: the grammar fill on the engine thread, not overlapping the processing "
        "of the step before",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="a folder: after the timed steps, a torch profiler trace of --trace-steps more per mode",
    )
    parser.add_argument("--trace-steps", type=int, default=20)
    args = parser.parse_args()
    if args.model is not None and args.vocab is not None:
        parser.error("--model and --vocab are alternatives")
    if args.bpe and args.vocab is None:
        parser.error("--bpe needs --vocab")

    from modelfleet.dataplane.demo import create_demo_model
    from modelfleet.dataplane.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    timer = PartTimer()
    with tempfile.TemporaryDirectory() as tmp:
        if args.vocab is not None:
            model_dir = padded_demo_model(Path(tmp) / f"padded-{args.vocab}", args.vocab)
            if args.bpe:
                model_dir = with_bpe_tokenizer(model_dir)
        else:
            model_dir = args.model or create_demo_model(Path(tmp) / "tiny", size="tiny")
        engine = LLMEngine.from_kwargs(
            str(model_dir),
            device=args.device,
            dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
            max_num_seqs=args.num_seqs,
            max_num_batched_tokens=max(2048, args.num_seqs * args.prompt_len),
            max_model_len=1024,
        )
        vocab = engine.model_config.vocab_size
        for mode in args.modes:
            print(json.dumps(run_mode(engine, timer, mode, args, vocab)), flush=True)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
