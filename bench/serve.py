"""Serving benchmark in the manner of `vllm bench serve`: random prompts, Poisson arrivals or a fixed
concurrency, streaming completions; prints one JSON line with request and token throughput and mean,
median and p99 of TTFT, TPOT, ITL and end-to-end latency.

With --model (or --demo) it starts `modelfleet serve` itself and, as the baseline in the same run, drives
the same prompts through the same kind of engine the server loads (a child process on a GPU, a thread on
the CPU), without HTTP, so the server's overhead shows.
    python bench/serve.py --demo small --num-prompts 64 --max-concurrency 8
    python bench/serve.py --base-url http://localhost:8000 --model-name demo --request-rate 4

With --streams it runs the front end's scale suite, one JSON line per case (150 to 250 s on an H100):
    python bench/serve.py --preset llama-3.2-1b --num-prompts 512 --input-len 128 --output-len 128 \\
        --engine max_num_seqs=512 --engine kv_cache_bytes=8589934592 --engine max_model_len=4096 \\
        --streams 64 256 512

--structured measures structured output instead: the same chat prompts, plain and then constrained by a
JSON schema (response_format), against one server in the same run; one JSON line for each. --schema long
(the default: strings of maxLength 12) or records (typical records: integer, string, enum, array), or
--json-schema FILE. A --preset is served with a byte-level BPE tokenizer (with_bpe_tokenizer).
    python bench/serve.py --demo small --structured --num-prompts 128 --max-concurrency 64
    python bench/serve.py --preset llama-3.2-1b --structured --schema records --num-prompts 256 \\
        --max-concurrency 64 --input-len 128 --output-len 128 [--rounds 5]
--rounds N repeats the pair N times, alternating, and prints the ratios' median and spread last: on a GPU
host one pair's ratio moves by +-0.08 with no change at all.

The suite's A/B case (two versions 50/50 on one device) runs on a server of its own: --ab-rounds rounds of
the pair, then one version alone on that server (`name@a`), alternating; the line gives each round's ratio
and their median.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

try:
    import aiohttp
except ImportError:  # a GPU host may lack it: raw_http_sender streams over asyncio's own sockets
    aiohttp = None


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    version: str = ""  # the version that answered (x-modelfleet-version)
    started: float = field(default_factory=time.perf_counter)
    last: float = 0.0

    def arrived(self) -> None:
        """Tokens arrived now: the first token's latency, or one more inter-token gap."""
        now = time.perf_counter()
        if self.ttft == 0.0:
            self.ttft = now - self.started
        else:
            self.itl.append(now - self.last)
        self.last = now

    def done(self) -> Result:
        self.e2e, self.ok = time.perf_counter() - self.started, True
        return self

    def read_event(self, line: bytes, has_text) -> bool:
        """Reads one SSE line of the answer; False once the stream reported an error."""
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            return True
        chunk = json.loads(line[6:])
        if "error" in chunk:
            self.error = chunk["error"]["message"]
            return False
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and has_text(chunk["choices"][0]):
            self.arrived()
        return True


def completion_text(choice: dict) -> bool:
    return bool(choice.get("text"))


def chat_text(choice: dict) -> bool:
    return bool(choice.get("delta", {}).get("content"))


def completion_body(model: str, prompt: list[int], output_len: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def post_stream(session: aiohttp.ClientSession, url: str, body: dict, has_text) -> Result:
    """POSTs one streaming request and times its answer's events."""
    result = Result()
    try:
        async with session.post(url, json=body) as response:
            result.version = response.headers.get("x-modelfleet-version", "")
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw in response.content:
                if not result.read_event(raw, has_text):
                    return result
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    return result.done()


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: the demo tokenizers keep special tokens there.
    return [[rng.randrange(16, vocab) for _ in range(input_len)] for _ in range(n)]


async def arrivals(n: int, rate: float, seed: int):
    """Yields request indices, spaced by exponential gaps (a Poisson process) unless rate is infinite."""
    rng = random.Random(seed + 1)
    for i in range(n):
        yield i
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))


async def run_load(send, prompts, rate: float, max_concurrency: int | None, seed: int):
    gate = asyncio.Semaphore(max_concurrency or len(prompts))
    results: list[Result] = []

    async def one(prompt):
        async with gate:
            results.append(await send(prompt))

    started = time.perf_counter()
    tasks = [asyncio.create_task(one(prompts[i])) async for i in arrivals(len(prompts), rate, seed)]
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def http_sender(session: aiohttp.ClientSession, url: str, model: str, output_len: int):
    """Streams one completion per call. aiohttp, as `vllm bench serve` uses: an httpx client parsing
    SSE fell behind a local server streaming ~4k tokens/s on two cores, and its own queueing showed up
    as seconds of time to first token (bench/stream_overhead.py)."""

    async def send(prompt: list[int]) -> Result:
        body = completion_body(model, prompt, output_len)
        return await post_stream(session, f"{url}/v1/completions", body, completion_text)

    return send


# --structured's schemas (--schema), each an array far longer than any output, so every token is
# constrained. "long": short strings only (maxLength 12).
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 4096}
    },
    "required": ["items"],
    "additionalProperties": False,
}
# "records": a typical schema, records of a bounded integer, a bounded string, an enum and an array of
# bounded strings (bounded, so that even a random-weight model's answer goes through every field).
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["id", "name", "status", "tags"],
    "additionalProperties": False,
}
RECORDS_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 1024}},
    "required": ["records"],
    "additionalProperties": False,
}
SCHEMAS = {"long": LONG_SCHEMA, "records": RECORDS_SCHEMA}
WORDS = "the a of to in is it that for on with as was by at from this be or are an have".split()  # noqa: SIM905


def chat_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(n)]


def chat_sender(session: aiohttp.ClientSession, url: str, model: str, output_len: int, schema: dict | None):
    """Streams one chat completion per call, constrained by `schema` (response_format) when given. A plain
    one ignores end of sequence; a constrained one cannot (its JSON ends it), so its schema must not end
    within output_len tokens for the two to produce as many tokens (each line reports its count)."""

    async def send(prompt: str) -> Result:
        body: dict = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if schema is None:
            body["ignore_eos"] = True
        else:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": schema},
            }
        return await post_stream(session, f"{url}/v1/chat/completions", body, chat_text)

    return send


def with_bpe_tokenizer(model_dir: Path) -> Path:
    """A preset's checkpoint for --structured: its word-level tokenizer ("t17" words) has no JSON punctuation
    and no chat template, so a sibling folder links its weights beside a byte-level BPE tokenizer of
    about its vocabulary (trained once on Python's standard library sources, ~10 s) with the demo
    models' chat template."""
    from modelfleet.dataplane.demo.tokenizer import SPECIAL_TOKENS, tokenizer_config
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = model_dir.with_name(model_dir.name + "-bpe")
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if not path.name.startswith("tokenizer") and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config["vocab_size"],
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_stdlib_lines(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    settings = tokenizer_config(config.get("max_position_embeddings", 4096))
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return out


def _stdlib_lines(limit: int = 200 << 20):
    """The lines of Python's standard library sources (up to `limit` characters), in a fixed order."""
    import sysconfig

    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from text.splitlines()
        total += len(text)
        if total > limit:
            return


def structured_problem(model_dir: Path, schema: dict) -> str | None:
    """Why the checkpoint's tokenizer cannot run --structured (no chat template, or no token that starts
    the schema's JSON), or None. Both modes use chat completions; a grammar that allows no first token
    would measure nothing."""
    import transformers
    import xgrammar

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        return f"{model_dir}'s tokenizer has no chat template"
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    xgrammar.GrammarMatcher(grammar).fill_next_token_bitmask(mask)
    if not mask.any():
        return f"no token of {model_dir}'s tokenizer starts the schema's JSON"
    return None


async def run_structured(url: str, model: str, args, schema: dict) -> list[dict]:
    """Plain, then JSON-schema chat completions of the same prompts on one server, --rounds times (the
    modes alternating); both warmed first by a full batch (the schema's grammar is compiled once, by the
    warm-up). Each round's constrained line carries its ratio to the plain one of the same round."""
    prompts = chat_prompts(args.num_prompts, args.input_len, args.seed)
    reports = []
    async with http_session(args.max_concurrency or len(prompts)) as session:
        senders = {
            "plain": chat_sender(session, url, model, args.output_len, None),
            "json_schema": chat_sender(session, url, model, args.output_len, schema),
        }
        warm = prompts[: args.max_concurrency or len(prompts)]  # a full batch of each, so neither runs cold
        for send in senders.values():
            await run_load(send, warm, float("inf"), None, args.seed)
        for round_ in range(args.rounds):
            for mode, send in senders.items():
                results, duration = await run_load(
                    send, prompts, args.request_rate, args.max_concurrency, args.seed
                )
                reports.append(
                    {"mode": mode, "round": round_, **summarize(results, duration, args.input_len)}
                )
            plain, constrained = reports[-2:]
            if plain["output_throughput_tok_s"]:
                constrained["structured_vs_plain_output_throughput"] = round(
                    constrained["output_throughput_tok_s"] / plain["output_throughput_tok_s"], 3
                )
    return reports


def structured_summary(lines: list[dict]) -> dict | None:
    """The rounds' ratios, their median and spread: one run's ratio moves by +-0.08 on a GPU host with no
    change at all (docs/benchmarks.md), so a change is judged on several rounds."""
    ratios = [
        line["structured_vs_plain_output_throughput"]
        for line in lines
        if "structured_vs_plain_output_throughput" in line
    ]
    if not ratios:
        return None
    return rounds_summary("structured_vs_plain", ratios)


def rounds_summary(name: str, ratios: list[float]) -> dict:
    """Several rounds' ratios under `name`, with their median and spread."""
    return {
        f"{name}_ratios": ratios,
        f"{name}_median": round(statistics.median(ratios), 3),
        f"{name}_spread": round(max(ratios) - min(ratios), 3),
    }


def raw_http_sender(url: str, model: str, output_len: int):
    """What http_sender does, over asyncio streams (one connection per request), for hosts without
    aiohttp. uvicorn sends each SSE event in one chunk, so event lines never straddle chunk headers."""
    host, _, port = url.removeprefix("http://").partition(":")

    async def send(prompt: list[int]) -> Result:
        body = json.dumps(completion_body(model, prompt, output_len)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        result = Result()
        try:
            reader, writer = await asyncio.open_connection(host, int(port or 80), limit=1 << 22)
        except OSError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        try:
            writer.write(head + body)
            status = int((await reader.readline()).split()[1])
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "x-modelfleet-version":
                    result.version = value.strip()
            if status != 200:
                result.error = f"HTTP {status}: {(await reader.read(400))!r}"
                return result
            while line := await reader.readline():
                if not result.read_event(line, completion_text):
                    return result
        except (OSError, ValueError, IndexError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        finally:
            writer.close()
        return result.done()

    return send


def engine_sender(engine, output_len: int):
    from modelfleet.dataplane import SamplingParams

    # delta outputs, as the server asks for
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, output_kind="delta")
    counter = iter(range(1 << 62))

    async def send(prompt: list[int]) -> Result:
        result = Result()
        async for output in engine.generate(prompt, params, request_id=f"bench-{next(counter)}"):
            if output.new_token_ids:
                result.arrived()
            result.output_tokens += len(output.new_token_ids)
        return result.done()

    return send


def summarize(results: list[Result], duration: float, input_len: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "median": None, "p99": None}
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return {
            "mean": round(statistics.fmean(ordered) * 1000, 2),
            "median": round(statistics.median(ordered) * 1000, 2),
            "p99": round(p99 * 1000, 2),
        }

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_tokens": out_tokens,
        "output_throughput_tok_s": round(out_tokens / duration, 2),
        "total_token_throughput_tok_s": round((out_tokens + input_len * len(ok)) / duration, 2),
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats(tpot),
        "itl_ms": stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": stats([r.e2e for r in ok]),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def start_server(
    model_dir: Path | None,
    name: str,
    engine: list[str],
    *,
    manifest: Path | None = None,
    stream_relays: int | None = None,
    gpu_sharing: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """`modelfleet serve` for one model folder (with `engine` settings), or for a manifest file; with
    `stream_relays` or `gpu_sharing`, that MODELFLEET_STREAM_RELAYS or MODELFLEET_GPU_SHARING (else the
    server's default or the environment's)."""
    port = free_port()
    command = [sys.executable, "-m", "modelfleet.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--log-level", "warning"]
    if manifest is not None:
        command += ["--manifest", str(manifest)]
    else:
        command += ["--model", str(model_dir), "--name", name]
        for pair in engine:
            command += ["--engine", pair]
    env = dict(os.environ)
    if stream_relays is not None:
        env["MODELFLEET_STREAM_RELAYS"] = str(stream_relays)
    if gpu_sharing is not None:
        env["MODELFLEET_GPU_SHARING"] = gpu_sharing
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"error: the server exited: {process.stderr.read().strip().splitlines()[-1:]}")
        if ready(url):
            return process, url
        time.sleep(0.25)
    process.terminate()
    raise SystemExit("error: the server did not become ready within 300 s")


def engine_settings(pairs: list[str]) -> dict:
    settings = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


async def run_baseline(model_dir: Path, args, prompts, concurrencies: list[int | None] | None = None):
    """The server's own engine for this model (its loader: a child process on a GPU), driven without
    HTTP: one summary, or one per concurrency given (the engine loaded once)."""
    from modelfleet.dataplane.server.loading import load_engine
    from modelfleet.dataplane.server.model_manager import VersionSpec

    settings = tuple((key, json.dumps(value)) for key, value in engine_settings(args.engine).items())
    engine = load_engine(VersionSpec("bench", "baseline", str(model_dir), settings))
    summaries = []
    try:
        send = engine_sender(engine, args.output_len)
        await run_load(send, prompts[:2], float("inf"), None, args.seed)  # warm
        for concurrency in concurrencies or [args.max_concurrency]:
            results, duration = await run_load(send, prompts, args.request_rate, concurrency, args.seed)
            summaries.append(summarize(results, duration, args.input_len))
    finally:
        engine.close()
    return summaries if concurrencies else summaries[0]


def ab_manifest(path: Path, model_dir: Path, name: str, engine: dict) -> Path:
    """Two versions of one model on one device, 50/50, each with half the KV-cache bytes."""
    halved = {**engine, "kv_cache_bytes": int(engine.get("kv_cache_bytes", 1 << 30)) // 2}
    versions = ", ".join(
        f'{{name: {v}, weight: 50, artifact: "{model_dir}", preload: true}}' for v in ("a", "b")
    )
    path.write_text(
        f"models:\n  - name: {name}\n    engine: {json.dumps(halved)}\n    versions: [{versions}]\n"
    )
    return path


def run_suite(args, model_dir: Path, prompts: list[list[int]]) -> int:
    """The front end at scale, one JSON line per case: the server at each --streams count against the
    engine alone in the same run, then an A/B pair of versions on one device against one version alone."""
    streams = sorted(set(args.streams))
    base = {
        "bench": "serve",
        "model": args.preset or str(model_dir),
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "engine": engine_settings(args.engine),
        "cpu_count": os.cpu_count(),
        "device": device_name(),
        "uvloop": importlib.util.find_spec("uvloop") is not None,  # uvicorn's loop when installed
        "aiohttp_client": aiohttp is not None,
    }
    relay_counts = args.stream_relays or [None]  # None: the server's own default
    served: dict[int | None, dict[int, dict]] = {}
    engine_alone: list[dict] = []
    for relays in relay_counts:
        served[relays] = {}
        process, url = start_server(model_dir, args.model_name, args.engine, stream_relays=relays)
        try:
            for n in streams:
                served[relays][n] = asyncio.run(
                    run_http(url, args.model_name, with_concurrency(args, n), prompts, server_pid=process.pid)
                )
        finally:
            process.terminate()
            process.wait(timeout=60)
        if not engine_alone:  # between the first server and the next, so that drift falls on both
            engine_alone = asyncio.run(run_baseline(model_dir, args, prompts, list(streams)))
    failed = 0
    for relays in relay_counts:
        for n, alone in zip(streams, engine_alone, strict=True):
            server = served[relays][n]
            failed += server["failed"]
            line = {**base, "case": "streams", "max_concurrency": n, "stream_relays": relays}
            line.update(server=server, engine_baseline=alone, **ratios(server, alone))
            print(json.dumps(line), flush=True)
    for sharing in args.ab_gpu_sharing:
        rounds = run_pair(args, model_dir, prompts, relay_counts[-1], sharing)
        failed += sum(r["pair"]["failed"] + r["one_version"]["failed"] for r in rounds)
        summary = rounds_summary("pair_vs_one", [r["pair_vs_one_output_throughput"] for r in rounds])
        middle = sorted(rounds, key=lambda r: r["pair_vs_one_output_throughput"])[len(rounds) // 2]
        line = {
            **base,
            "case": "ab_50_50",
            "max_concurrency": args.ab_streams,
            # what the operator gives a one-GPU NVIDIA pod (mps), or time-slicing (none)
            "gpu_sharing": sharing,
            "mps_control": shutil.which("nvidia-cuda-mps-control"),
            "pair": middle["pair"],  # the round of the median ratio
            "one_version": middle["one_version"],
            "pair_vs_one_output_throughput": summary["pair_vs_one_median"],
            **summary,
            "pair_output_tok_s": [r["pair"]["output_throughput_tok_s"] for r in rounds],
            "one_version_output_tok_s": [r["one_version"]["output_throughput_tok_s"] for r in rounds],
        }
        print(json.dumps(line), flush=True)
    return 0 if failed == 0 else 1


def run_pair(
    args, model_dir: Path, prompts: list[list[int]], relays: int | None, gpu_sharing: str
) -> list[dict]:
    """The A/B case on one server holding two versions of the model, 50/50, once warm: each of
    --ab-rounds rounds loads the pair (the model's name: the split), then one version alone on the same
    server (`name@a`: every request to version a, b idle), so that the host's drift between rounds falls
    on both. (One version on a server of its own, as measured before, moved 36-63k output tokens/s between
    runs on one H200 host while the pair stayed at 47-49k.) Version a holds half the KV bytes here, far
    more than --ab-streams sequences need."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        manifest = ab_manifest(
            Path(tmp) / "ab.yaml", model_dir, args.model_name, engine_settings(args.engine)
        )
        process, url = start_server(
            None, args.model_name, [], manifest=manifest, stream_relays=relays, gpu_sharing=gpu_sharing
        )
        try:
            pair_args = with_concurrency(args, args.ab_streams)
            asyncio.run(run_http(url, args.model_name, pair_args, prompts[: 2 * args.ab_streams]))  # warm-up
            load = functools.partial(run_http, by_version=True, server_pid=process.pid)
            rounds = []
            for _ in range(args.ab_rounds):
                pair = asyncio.run(load(url, args.model_name, pair_args, prompts))
                one = asyncio.run(load(url, f"{args.model_name}@a", pair_args, prompts))
                ratio = round(pair["output_throughput_tok_s"] / max(one["output_throughput_tok_s"], 1e-9), 3)
                rounds.append({"pair": pair, "one_version": one, "pair_vs_one_output_throughput": ratio})
            return rounds
        finally:
            process.terminate()
            process.wait(timeout=60)


def with_concurrency(args, n: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "max_concurrency": n})


def ratios(server: dict, engine: dict) -> dict:
    """The figures issue-style goals compare: server over engine throughput, and ITL against ITL."""
    out = {}
    if engine["output_throughput_tok_s"]:
        out["server_vs_engine_output_throughput"] = round(
            server["output_throughput_tok_s"] / engine["output_throughput_tok_s"], 3
        )
    if server["itl_ms"]["median"] and engine["itl_ms"]["median"]:
        out["server_vs_engine_median_itl"] = round(server["itl_ms"]["median"] / engine["itl_ms"]["median"], 3)
    return out


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def http_session(max_connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections), timeout=aiohttp.ClientTimeout(total=600)
    )


async def load_http(
    url: str,
    model: str,
    output_len: int,
    prompts,
    rate: float,
    concurrency: int | None,
    seed: int,
    warmed=lambda: None,
) -> tuple[list[Result], float]:
    """One client's load (one event loop): a warm-up, `warmed()`, then the prompts."""
    if aiohttp is None:
        send = raw_http_sender(url, model, output_len)
        await run_load(send, prompts[:2], float("inf"), None, seed)
        warmed()
        return await run_load(send, prompts, rate, concurrency, seed)
    async with http_session(concurrency or len(prompts)) as session:
        send = http_sender(session, url, model, output_len)
        await run_load(send, prompts[:2], float("inf"), None, seed)
        warmed()
        return await run_load(send, prompts, rate, concurrency, seed)


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc; psutil may be missing on a GPU host)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_process(job: tuple, barrier, replies) -> None:
    """A client process of split_load: its share of the prompts, started once every client is warm."""
    cpu = time.process_time()
    results, duration = asyncio.run(load_http(*job, warmed=barrier.wait))
    finished = time.perf_counter()
    replies.put((results, finished - duration, finished, time.process_time() - cpu))


def split_load(url: str, model: str, args, prompts, processes: int) -> tuple[list[Result], float, float]:
    """The load over several client processes (spawned), each with a share of the prompts and of the
    concurrency: one Python client parsing every event of hundreds of fast streams saturates its core
    and would measure itself, not the server. Returns the results, the wall time from the first start
    to the last end (perf_counter is one clock for all processes), and the busiest client's CPU use."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    concurrency = args.max_concurrency or len(prompts)
    processes = max(1, min(processes, concurrency, len(prompts)))
    barrier, replies = context.Barrier(processes), context.Queue()
    rate = args.request_rate / processes
    clients = []
    for i in range(processes):
        share = concurrency // processes + (1 if i < concurrency % processes else 0)
        job = (url, model, args.output_len, prompts[i::processes], rate, share, args.seed + i)
        clients.append(context.Process(target=_client_process, args=(job, barrier, replies), daemon=True))
        clients[-1].start()
    replies_got = [replies.get(timeout=900) for _ in clients]
    for client in clients:
        client.join(timeout=30)
    results = [r for reply in replies_got for r in reply[0]]
    started, finished = min(r[1] for r in replies_got), max(r[2] for r in replies_got)
    duration = finished - started
    return results, duration, max(r[3] for r in replies_got) / max(duration, 1e-9)


def server_ttft_totals(url: str) -> tuple[float, float] | None:
    """The server's own time-to-first-token histogram, summed over its labels: (seconds, requests);
    None where /metrics cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    from prometheus_client.parser import text_string_to_metric_families

    name = "modelfleet_time_to_first_token_seconds"
    totals = {f"{name}_sum": 0.0, f"{name}_count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    return totals[f"{name}_sum"], totals[f"{name}_count"]


async def run_http(
    url: str, model: str, args, prompts, *, by_version: bool = False, server_pid: int | None = None
) -> dict:
    """The load against a server: one JSON summary; with the server's pid, its CPU use (1.0 is one
    core busy all along) and the busiest client's, so that a saturated side shows. `server_ttft_mean_ms`:
    the mean time from a request's arrival in the server's endpoint to its first token (its /metrics),
    beside the client's TTFT, which adds the time before the server took the request in."""
    before = cpu_seconds(server_pid) if server_pid is not None else 0.0
    ttft_before = server_ttft_totals(url)
    processes = getattr(args, "client_processes", 1)
    if processes > 1:
        loop = asyncio.get_running_loop()
        results, duration, client_cpu = await loop.run_in_executor(
            None, split_load, url, model, args, prompts, processes
        )
    else:
        cpu = time.process_time()
        results, duration = await load_http(
            url, model, args.output_len, prompts, args.request_rate, args.max_concurrency, args.seed
        )
        client_cpu = (time.process_time() - cpu) / max(duration, 1e-9)  # warm-up included: a bound
    summary = summarize(results, duration, args.input_len)
    summary["client_processes"] = processes
    summary["client_cpu_util_max"] = round(client_cpu, 3)
    if server_pid is not None:
        summary["server_cpu_util"] = round((cpu_seconds(server_pid) - before) / max(duration, 1e-9), 3)
    ttft_after = server_ttft_totals(url)
    if ttft_before is not None and ttft_after is not None and ttft_after[1] > ttft_before[1]:
        seconds, requests = (after - first for after, first in zip(ttft_after, ttft_before, strict=True))
        summary["server_ttft_mean_ms"] = round(1e3 * seconds / requests, 2)
    if by_version:  # each version's figures over the same wall time (their throughputs add up)
        versions = sorted({r.version for r in results if r.ok})
        summary["versions"] = {
            v: summarize([r for r in results if r.version == v], duration, args.input_len) for v in versions
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="an already running server")
    target.add_argument(
        "--model", type=Path, help="model folder: start a server for it (and run the baseline)"
    )
    target.add_argument("--demo", choices=["tiny", "small"], help="create (once) and serve a demo model")
    target.add_argument(
        "--preset",
        choices=["llama-3.2-1b", "llama-3.1-8b"],
        help="build (once, under --demo-dir) a random-weight checkpoint of this shape and serve it",
    )
    parser.add_argument("--model-name", default="bench", help="model name to request")
    parser.add_argument(
        "--vocab-size", type=int, help="token ids are drawn below this (default: from config)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals"
    )
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="engine setting")
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-process engine baseline")
    parser.add_argument(
        "--streams",
        type=int,
        nargs="+",
        help="the scale suite: the server at each of these concurrencies against the engine alone, then "
        "two versions 50/50 on one device against one version (one JSON line per case)",
    )
    parser.add_argument("--ab-streams", type=int, default=128, help="concurrency of the suite's A/B case")
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=2,
        help="the A/B case's rounds on its server, each the pair then one version alone; the line gives "
        "each round's ratio and their median",
    )
    parser.add_argument(
        "--ab-gpu-sharing",
        nargs="+",
        choices=["mps", "none"],
        default=["mps"],
        help="the A/B case's MODELFLEET_GPU_SHARING, one pair per value in this order (mps: what the "
        "operator gives a one-GPU NVIDIA pod)",
    )
    parser.add_argument(
        "--stream-relays",
        type=int,
        nargs="+",
        help="the suite's servers: one per count of MODELFLEET_STREAM_RELAYS, in this order (the A/B case "
        "takes the last); default: one server with the default",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes sharing the load (each parses its streams' events on its own core); "
        "each JSON summary reports the busiest client's CPU use",
    )
    parser.add_argument("--demo-dir", type=Path, default=Path(".modelfleet/bench"))
    parser.add_argument(
        "--structured", action="store_true", help="plain vs JSON-schema chat completions, one line each"
    )
    parser.add_argument(
        "--schema", choices=sorted(SCHEMAS), default="long", help="--structured's built-in schema"
    )
    parser.add_argument(
        "--json-schema", type=Path, help="a schema file for --structured, instead of --schema"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--structured: plain and constrained this many times, alternating; with more than one, a last "
        "line gives the ratios' median and spread",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.ab_rounds < 1:
        parser.error("--rounds and --ab-rounds: at least 1")

    model_dir = args.model
    if args.demo:
        from modelfleet.dataplane.demo import create_demo_model

        model_dir = args.demo_dir / args.demo
        if not (model_dir / "model.safetensors").is_file():
            model_dir = create_demo_model(model_dir, size=args.demo, seed=0, force=True)
    if args.preset:
        import torch
        from throughput import build_preset

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model_dir = Path(build_preset(args.preset, args.demo_dir / args.preset, device))
    vocab = args.vocab_size
    if vocab is None and model_dir is not None:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if vocab is None:
        parser.error("--vocab-size is needed with --base-url")
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    if args.streams:
        if model_dir is None:
            parser.error("--streams starts its own servers: give --model, --demo or --preset")
        return run_suite(args, model_dir, prompts)

    report = {
        "bench": "serve",
        "model": str(model_dir or args.base_url),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "cpu_count": os.cpu_count(),
    }
    if args.structured:
        schema = json.loads(args.json_schema.read_text()) if args.json_schema else SCHEMAS[args.schema]
        report["schema"] = str(args.json_schema) if args.json_schema else args.schema
        if args.preset:
            model_dir = with_bpe_tokenizer(model_dir)
            report["model"] = str(model_dir)
        problem = structured_problem(model_dir, schema) if model_dir is not None else None
        if problem:
            parser.error(f"--structured: {problem}")
        process, url = (
            (None, args.base_url) if args.base_url else start_server(model_dir, args.model_name, args.engine)
        )
        try:
            lines = asyncio.run(run_structured(url, args.model_name, args, schema))
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
        for line in lines:
            print(json.dumps({**report, "bench": "serve_structured", **line}))
        summary = structured_summary(lines)
        if summary is not None and args.rounds > 1:
            print(
                json.dumps({**report, "bench": "serve_structured_rounds", "rounds": args.rounds, **summary})
            )
        return 0 if all(line["failed"] == 0 for line in lines) else 1
    if args.base_url:
        report["server"] = asyncio.run(run_http(args.base_url, args.model_name, args, prompts))
    else:
        process, url = start_server(model_dir, args.model_name, args.engine)
        try:
            report["server"] = asyncio.run(
                run_http(url, args.model_name, args, prompts, server_pid=process.pid)
            )
        finally:
            process.terminate()
            process.wait(timeout=30)
        if not args.no_baseline:
            report["engine_baseline"] = asyncio.run(run_baseline(model_dir, args, prompts))
            base = report["engine_baseline"]["output_throughput_tok_s"]
            if base:
                report["server_vs_engine_output_throughput"] = round(
                    report["server"]["output_throughput_tok_s"] / base, 3
                )
    print(json.dumps(report))
    return 0 if report["server"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
