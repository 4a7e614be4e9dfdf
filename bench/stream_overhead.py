"""The HTTP server's own cost of streaming: its CPU time per streamed token, with the engine left out.

A stand-in engine on AsyncLLM's delivery path (a thread handing each running request one token per
--step-ms, as an engine step does) is served by the real app (routing, admission, metrics, spans, SSE)
in a uvicorn subprocess; bench/serve.py's client streams completions from it at a fixed concurrency.
Prints one JSON line: the server process's CPU microseconds per streamed token and what the client saw
(throughput, TTFT, ITL). With --delivery both, a server whose stand-in engine wakes the event loop once
per stream and step (the baseline) is measured first, in the same run. At 64 streams and a 3 ms step a
server keeps up only below ~250 us per token. With --gc-freeze both, a server whose heap the garbage
collector walks in full (ServerSettings.gc_freeze off) is the baseline; --output-len 2 makes each
request's own cost (routing, spans, admission, first chunk) most of what is measured.

    python bench/stream_overhead.py --num-prompts 256 --max-concurrency 64 --output-len 64 --delivery both
    python bench/stream_overhead.py --num-prompts 4096 --max-concurrency 256 --input-len 128 --output-len 2 \
        --gc-freeze both
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from serve import free_port, http_sender, http_session, random_prompts, run_load, summarize
from throughput import write_word_tokenizer

VOCAB = 1000


def _limits():
    from modelfleet.dataplane.engine.protocol import EngineLimits

    return EngineLimits(max_num_seqs=1024, max_model_len=4096, vocab_size=VOCAB)


def stand_in_engine(folder: str, step_s: float, per_output: bool = False):
    from modelfleet.dataplane.engine.messages import Add
    from modelfleet.dataplane.engine.threaded import ThreadedEngine
    from transformers import AutoTokenizer

    class StandInEngine(ThreadedEngine):
        """Each running request gets one token (" t<n>") per step; no model."""

        limits = _limits()

        def __init__(self) -> None:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self._running: dict[str, tuple[int, int]] = {}
            self._start("stand-in-engine")

        def validate(self, prompt, params):
            return list(prompt), params

        def stats(self):
            return _stats(self._running)

        def _run(self) -> None:
            while not self._closed:
                started = time.perf_counter()
                while self._commands:
                    command = self._commands.popleft()
                    if isinstance(command, Add):
                        self._running[command.request_id] = (command.validated[1].max_tokens, 0)
                    else:
                        self._running.pop(command.request_id, None)
                step = [(output.request_id, output) for output in _step_outputs(self._running)]
                if per_output:  # the baseline: one wake-up of the event loop per stream and step
                    for request_id, output in step:
                        self._deliver(request_id, output)
                else:
                    self._deliver_all(step)
                time.sleep(max(step_s - (time.perf_counter() - started), 0.0))

    return StandInEngine()


def _stats(running: dict):
    from modelfleet.dataplane.engine.outputs import EngineStats

    return EngineStats(len(running), 0, 0.0, 0.0, 1, 1)


def _step_outputs(running: dict[str, tuple[int, int]]) -> list:
    """One step of a stand-in: each running request (id -> max tokens, tokens made) gets its next token
    (" t<n>"), as a delta output; finished ones leave `running`."""
    from modelfleet.dataplane.engine.outputs import RequestOutput

    outputs = []
    for request_id, (max_tokens, made) in list(running.items()):
        token = made + 1
        finished = token == max_tokens
        outputs.append(
            RequestOutput(
                request_id, [], text=f" t{token}", token_ids=[token], new_text=f" t{token}",
                new_token_ids=[token], finish_reason="length" if finished else None, finished=finished,
                delta=True,
            )
        )  # fmt: skip
        if finished:
            del running[request_id]
        else:
            running[request_id] = (max_tokens, token)
    return outputs


def stand_in_process_main(conn, to_relays, step_s: float) -> None:
    """A stand-in engine process: engine_process's messages over its pipe (and its relays' pipes, through
    the same OutputRoutes), one token per running request and step, no model."""
    from modelfleet.dataplane.engine.engine_process import OutputRoutes
    from modelfleet.dataplane.engine.messages import Abort, Add, Close, Ready
    from modelfleet.dataplane.engine.outputs import RequestOutput

    conn.send(Ready(_limits(), _stats({})))
    routes = OutputRoutes(conn, to_relays)
    running: dict[str, tuple[int, int]] = {}
    while True:
        started = time.perf_counter()
        while not running or conn.poll():  # idle: wait for a command; busy: take what has arrived
            command = conn.recv()
            if isinstance(command, Close):
                return
            if isinstance(command, Add):
                running[command.request_id] = (command.validated[1].max_tokens, 0)
                routes.add(command.request_id, command.sink)
            elif isinstance(command, Abort) and running.pop(command.request_id, None) is not None:
                aborted = RequestOutput(
                    command.request_id, [], finish_reason="abort", finished=True, delta=True
                )
                routes.send([aborted], _stats(running))
        routes.send(_step_outputs(running), _stats(running))
        time.sleep(max(step_s - (time.perf_counter() - started), 0.0))


def stand_in_process_engine(folder: str, step_s: float, stream_relays: int = 0):
    """The server's real reader of an engine process (AsyncLLMProcess: its pipe, reader thread, delivery
    and stream relays), on a stand-in child instead of LLMEngine."""
    import functools

    from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess

    child = functools.partial(stand_in_process_main, step_s=step_s)
    return AsyncLLMProcess(folder, stream_relays=stream_relays, child=child)


def serve(
    port: int,
    step_ms: float,
    per_output: bool,
    loop: str,
    engine: str = "thread",
    stream_relays: int = 0,
    gc_freeze: bool = True,
) -> None:
    import uvicorn
    from modelfleet.dataplane.manifest import single_model_manifest
    from modelfleet.dataplane.server.runtime import build_app
    from modelfleet.dataplane.server.settings import ServerSettings

    folder = tempfile.mkdtemp(prefix="stand-in-")
    write_word_tokenizer(folder, VOCAB)
    manifest = single_model_manifest(folder, name="bench")
    app = build_app(
        ServerSettings(max_tokens_limit=100_000, gc_freeze=gc_freeze),
        manifest,
        loader=lambda spec: (
            stand_in_process_engine(folder, step_ms / 1e3, stream_relays)
            if engine == "process"
            else stand_in_engine(folder, step_ms / 1e3, per_output)
        ),
        estimate_bytes=lambda spec: 0,
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop=loop)


def start_profiler(path: str | None, pid: int) -> subprocess.Popen | None:
    """py-spy sampling the server process (from outside it: it adds no work there) while the load runs;
    its stacks, collapsed one per line, go to `path`."""
    if not path:
        return None
    if shutil.which("py-spy") is None:
        raise SystemExit("error: --profile needs py-spy on PATH (pip install py-spy)")
    command = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "250", "-o", path]
    return subprocess.Popen([*command, "--nonblocking"], stdout=subprocess.DEVNULL)


def stop_profiler(profiler: subprocess.Popen | None) -> None:
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        profiler.wait(timeout=60)


def measure(args: argparse.Namespace, delivery: str, gc_freeze: bool = True) -> dict:
    """One server (with `delivery`, its heap frozen or not), loaded by the client; the server's CPU time
    per token and the client's summary."""
    port = free_port()
    command = [sys.executable, str(Path(__file__).resolve()), "--serve-port", str(port)]
    command += ["--step-ms", str(args.step_ms), "--delivery", delivery, "--loop", args.loop]
    command += ["--gc-freeze", "on" if gc_freeze else "off"]
    command += ["--engine", args.engine, "--stream-relays", str(args.stream_relays)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("error: the server did not become ready")
            time.sleep(0.2)
        prompts = random_prompts(args.num_prompts, args.input_len, VOCAB, seed=0)
        process = psutil.Process(server.pid)

        async def load() -> tuple[list, float, float]:
            async with http_session(args.max_concurrency) as session:
                send = http_sender(session, url, "bench", args.output_len)
                await run_load(send, prompts[:4], float("inf"), None, 0)  # warm-up
                profiler = start_profiler(args.profile, server.pid)
                try:  # a failed load does not leave py-spy running
                    before = sum(process.cpu_times()[:2])
                    results, duration = await run_load(send, prompts, float("inf"), args.max_concurrency, 0)
                    return results, duration, sum(process.cpu_times()[:2]) - before
                finally:
                    stop_profiler(profiler)

        results, duration, cpu_s = asyncio.run(load())
    finally:
        server.terminate()
        server.wait(timeout=30)
    summary = summarize(results, duration, args.input_len)
    tokens = sum(r.output_tokens for r in results if r.ok)
    return {
        "delivery": delivery,
        "gc_freeze": gc_freeze,
        "server_cpu_us_per_token": round(1e6 * cpu_s / max(tokens, 1), 1),
        "client": summary,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument(
        "--delivery",
        choices=["step", "output", "both"],
        default="step",
        help="how the stand-in engine hands out a step's tokens: one event-loop wake-up per step (as "
        "the engines do), one per output (the baseline), or both in one run",
    )
    parser.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="the server's event loop (auto: uvloop when installed, as uvicorn picks in production)",
    )
    parser.add_argument(
        "--engine",
        choices=["thread", "process"],
        default="thread",
        help="the stand-in engine on a thread of the server (AsyncLLM's delivery) or in a process of its "
        "own behind the server's real engine-process reader (AsyncLLMProcess: pipe, pickled outputs, "
        "reader thread), as the GPU images serve; its CPU is not counted",
    )
    parser.add_argument(
        "--stream-relays",
        type=int,
        default=0,
        help="with --engine process: relay processes that write the streams after their first token "
        "(the server's MODELFLEET_STREAM_RELAYS); their CPU is not counted as the server's",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="py-spy's samples of the server process during the load, collapsed stacks (one run: "
        "not with --delivery both)",
    )
    parser.add_argument(
        "--gc-freeze",
        choices=["on", "off", "both"],
        default="on",
        help="the server's heap kept out of the garbage collector's full passes (ServerSettings.gc_freeze, "
        "on by default), or not, or both in one run (off first: the baseline)",
    )
    parser.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_port:
        serve(
            args.serve_port,
            args.step_ms,
            args.delivery == "output",
            args.loop,
            args.engine,
            args.stream_relays,
            args.gc_freeze != "off",
        )
        return 0

    if args.profile and "both" in (args.delivery, args.gc_freeze):
        parser.error("--profile records one server: give one --delivery and one --gc-freeze")
    if args.delivery == "both" and args.gc_freeze == "both":
        parser.error("--delivery both and --gc-freeze both: one baseline per run")
    if args.engine == "process" and args.delivery != "step":
        parser.error("--engine process delivers as the engine process does: give --delivery step")
    if args.stream_relays and args.engine != "process":
        parser.error("--stream-relays: relays serve an engine process: give --engine process")
    if args.gc_freeze == "both":
        runs = [measure(args, args.delivery, gc_freeze) for gc_freeze in (False, True)]
    else:
        deliveries = ["output", "step"] if args.delivery == "both" else [args.delivery]
        runs = [measure(args, d, args.gc_freeze == "on") for d in deliveries]
    report = {
        "bench": "stream_overhead",
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "output_len": args.output_len,
        "step_ms": args.step_ms,
        "loop": args.loop,
        "engine": args.engine,
        "stream_relays": args.stream_relays,
        **runs[-1],
    }
    if len(runs) == 2:
        baseline = "baseline_gc_freeze_off" if args.gc_freeze == "both" else "baseline_per_output_delivery"
        report[baseline] = runs[0]
        report["cpu_per_token_vs_baseline"] = round(
            runs[1]["server_cpu_us_per_token"] / max(runs[0]["server_cpu_us_per_token"], 1e-9), 3
        )
    print(json.dumps(report))
    return 0 if all(run["client"]["failed"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
