"""A model.yaml's quantized version end to end on this machine, as the operator would run it on a cluster.

Builds a preset checkpoint (bench/throughput.py's random-weight Llama shapes, or the tiny demo model) at
the place the ModelVersion's pvc:// source names, then, for each --dtype:

  convert-<dtype>  the conversion Job's own command and environment (operator/reconcile/conversion.py)
                   for the version's quantized target on the InferenceModel's accelerator: the real
                   `modelfleet convert`, its exit code, the artifact the operator records from its
                   termination message (parse_summary), and the manifest's validation report (method,
                   rule, metrics, limits, bf16 baseline)

then serves the --serve dtype's artifact the way the Deployment would (operator/reconcile/serving.py):
the serving manifest the operator renders for the traffic it plans (the other versions have no
artifact, so this one takes all of it), `modelfleet serve` with the pod's args and env, on a local port:

  serve-ready      /ready answers 200
  chat             a chat completion: 200, the x-modelfleet-version header, the text and token counts
  chat-stream      the same streamed (SSE): every chunk, the header, [DONE], the usage chunk
  serve-stop       SIGTERM, as the kubelet stops a pod; the server must exit by itself

Paths inside the pods (/mnt/pvc, /models, /etc/modelfleet, /tmp, /dev/termination-log) are mapped to
folders under --work-dir. One JSON line per step on stdout, and a last `done` line; any failure names
its step (and the log file under --work-dir) and exits 1. Conversions all run before the first failure
is reported, so that each format's numbers show.

    python bench/quantized_e2e.py --preset llama-3.2-1b --device cuda            # int8, fp8, serve fp8
    python bench/quantized_e2e.py --preset llama-3.1-8b --device cuda --dtype fp8 --serve none
    python bench/quantized_e2e.py --preset demo-tiny --device cpu --dtype int8 --serve int8 -f MODEL_YAML
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("llama-3.2-1b", "llama-3.1-8b", "demo-tiny")
QUANTIZED = ("int8", "fp8")
# `modelfleet` as the images run it, from this interpreter (no reliance on PATH).
MODELFLEET = [sys.executable, "-m", "modelfleet.cli"]
PROMPT = "Name three things a model server does before it answers."
MAX_TOKENS = 16
VERSION_HEADER = "x-modelfleet-version"


class StepFailed(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step


def emit(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


@contextlib.contextmanager
def at(step: str) -> Iterator[None]:
    """An unforeseen error inside is the failure of `step` (a bug or a broken install still names it)."""
    try:
        yield
    except (StepFailed, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise StepFailed(step, f"{type(exc).__name__}: {exc}") from exc


# --- the model.yaml, as the operator reads it -----------------------------------------------------------


@dataclass
class Fleet:
    im: dict[str, Any]  # the InferenceModel object as stored
    mvs: dict[str, dict[str, Any]]  # ModelVersion objects by metadata.name


def load_fleet(path: Path, namespace: str = "default") -> Fleet:
    from modelfleet.operator.api import InferenceModel, ModelVersion

    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    models = [d for d in docs if d.get("kind") == "InferenceModel"]
    if len(models) != 1:
        raise ValueError(f"{path}: expected one InferenceModel, found {len(models)}")
    objects = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        doc.setdefault("metadata", {}).setdefault("namespace", namespace)
        doc["metadata"].setdefault("uid", f"local-{doc['metadata']['name']}")
        # the operator's own types: a field the CRD would refuse fails here too
        (InferenceModel if doc["kind"] == "InferenceModel" else ModelVersion).model_validate(doc)
        objects.append(doc)
    im = next(o for o in objects if o["kind"] == "InferenceModel")
    mvs = {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] == "ModelVersion" and o["spec"]["model"] == im["metadata"]["name"]
    }
    return Fleet(im, mvs)


def pick_version(fleet: Fleet, name: str | None) -> dict[str, Any]:
    if name:
        if name not in fleet.mvs:
            raise ValueError(
                f"--version {name!r}: no such ModelVersion of the model; have {sorted(fleet.mvs)}"
            )
        return fleet.mvs[name]
    quantized = [mv for mv in fleet.mvs.values() if mv["spec"].get("quantization", "none") != "none"]
    if not quantized:
        raise ValueError("no ModelVersion asks for quantization; name one with --version")
    return quantized[0]


def quantized_target(fleet: Fleet, mv: dict[str, Any], dtype: str):
    """The version's target of `dtype` on the model's accelerator, as the operator plans it (with
    spec.quantization set to `dtype`: the fp8 version asked for int8 is the int8 row of the same model)."""
    from modelfleet.operator.api import ModelVersionSpec
    from modelfleet.operator.reconcile.targets import resolve_targets

    spec = ModelVersionSpec.model_validate({**mv["spec"], "quantization": dtype})
    accelerator = fleet.im["spec"]["hardware"]["accelerator"]
    targets = [t for t in resolve_targets(spec, accelerator, tensorrt=False) if t.dtype == dtype]
    if not targets:
        raise ValueError(f"the operator plans no {dtype} target for {accelerator}")
    return targets[0]


# --- pod paths on this machine ------------------------------------------------------------------------


class Local:
    """Where each path a pod sees lives under the work folder."""

    def __init__(self, work: Path, settings) -> None:
        from modelfleet.operator.reconcile import conversion, serving

        self.work = work
        self.pvc_root = work / "pvc"
        store = self.pvc_root / settings.model_store_claim
        self.prefixes = [  # longest first
            (conversion.TERMINATION_LOG, str(work / "termination-log")),
            (conversion.PVC_ROOT, str(self.pvc_root)),
            (settings.model_store_path.rstrip("/"), str(store)),
            (serving.MANIFEST_DIR, str(work / "etc")),
            ("/tmp", str(work / "tmp")),
        ]
        for folder in (self.pvc_root, store, work / "etc", work / "tmp", work / "logs"):
            folder.mkdir(parents=True, exist_ok=True)

    def path(self, value: str) -> str:
        for pod, here in self.prefixes:
            if value == pod or value.startswith(pod + "/"):
                return here + value[len(pod) :]
        return value

    def env(self, container: dict[str, Any], pod_name: str) -> dict[str, str]:
        """The container's env as the kubelet gives it: fieldRefs filled in, $(VAR) expanded, pod paths
        mapped; Secret references are refused (the examples need none)."""
        env: dict[str, str] = {}
        for item in container.get("env", []):
            if "value" in item:
                value = item["value"]
                for name, known in env.items():
                    value = value.replace(f"$({name})", known)
                env[item["name"]] = self.path(value)
            elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
                env[item["name"]] = pod_name
            else:
                raise ValueError(f"env {item['name']}: cannot fill {item.get('valueFrom')} on this machine")
        return env


def source_folder(local: Local, mv: dict[str, Any], settings) -> Path:
    """The folder the converter will read for the version's source: the preset is built there."""
    from modelfleet.operator.reconcile.conversion import source_mount

    uri = source_mount(mv["spec"]["source"]["uri"], settings).uri
    if not uri.startswith("pvc://"):
        raise ValueError(f"source {mv['spec']['source']['uri']!r}: only pvc:// and file:// sources are local")
    return local.pvc_root / uri.removeprefix("pvc://")


# --- steps --------------------------------------------------------------------------------------------


def build(preset: str, folder: Path, device: str) -> dict[str, Any]:
    started = time.monotonic()
    if preset == "demo-tiny":
        from modelfleet.dataplane.demo import create_demo_model

        if not (folder / "config.json").is_file():  # reused like build_preset's
            create_demo_model(folder, size="tiny", seed=0)
    else:
        sys.path.insert(0, str(REPO / "bench"))
        from throughput import build_preset

        build_preset(preset, folder, device)
        add_chat_template(folder)
    if device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    return {"preset": preset, "device": device, "seconds": round(time.monotonic() - started, 1)}


def add_chat_template(folder: Path) -> None:
    """The presets' word tokenizer has no chat template; a served model needs one for chat completions
    (the demo model's ChatML turns: its marker words are unknown words to the preset, which is fine)."""
    from modelfleet.dataplane.demo.tokenizer import CHAT_TEMPLATE

    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if "chat_template" not in config:
        config["chat_template"] = CHAT_TEMPLATE
        path.write_text(json.dumps(config))


def convert(fleet: Fleet, mv: dict[str, Any], dtype: str, local: Local, settings, timeout: float) -> dict:
    from modelfleet.operator.api import ModelVersion
    from modelfleet.operator.reconcile.conversion import conversion_job, parse_summary

    step = f"convert-{dtype}"
    target = quantized_target(fleet, mv, dtype)
    job = conversion_job(mv, ModelVersion.model_validate(mv), target, settings)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = [local.path(a) for a in container["command"]]
    if command[:2] != ["modelfleet", "convert"]:
        raise StepFailed(step, f"the Job runs {command[:2]}, not modelfleet convert")
    env = {**os.environ, **local.env(container, pod_name=job["metadata"]["name"])}
    log = local.work / "logs" / f"{step}.log"
    started = time.monotonic()
    with log.open("w") as err:
        try:
            proc = subprocess.run(
                [*MODELFLEET, *command[1:]],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise StepFailed(step, f"no result in {timeout:.0f} s (log: {log})") from None
    seconds = round(time.monotonic() - started, 1)
    # What the operator reads: the termination message, through its own parser (the artifact it records
    # in the version's status, from which it plans the traffic), and the container's exit code.
    termination = Path(command[command.index("--termination-log") + 1])
    message = termination.read_text() if termination.is_file() else None
    result = parse_summary(message, target, proc.returncode)
    fields: dict[str, Any] = {
        "ok": proc.returncode == 0 and result.ok,
        "exitCode": proc.returncode,
        "seconds": seconds,
        "target": target.as_dict(),
        "job": container["command"],  # as the pod runs it; paths under /mnt/pvc are mapped here
    }
    if fields["ok"]:
        assert result.artifact is not None
        manifest = json.loads((Path(command[command.index("--out") + 1]) / "manifest.json").read_text())
        fields |= {
            "artifact": result.artifact,  # its "validation" is the summary's: method and rule included
            "conversionSeconds": manifest.get("conversionSeconds"),
            "validation": manifest["validation"],  # the full report: limits, baseline, failures
        }
    else:
        fields |= {
            "reason": result.reason,
            "message": result.message,
            "summaryValidation": _summary(message).get("validation"),  # a failed validation's figures
            "log": str(log),
            "logTail": log.read_text(errors="replace").splitlines()[-15:],
        }
    emit(step, **fields)
    return fields


def _summary(message: str | None) -> dict[str, Any]:
    try:
        summary = json.loads((message or "").strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


class Server:
    """`modelfleet serve` with the Deployment's container args and env."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("w") as out:
            # its own session: the engine's child processes go with it if it must be killed
            self.proc = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then the exit code; a server still running after `timeout` is killed (None)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_manifest(fleet: Fleet, mv: dict[str, Any], artifact: dict[str, Any], local: Local, settings):
    """The manifest the operator renders once `mv` has this artifact and no other version has one."""
    from modelfleet.operator.api import InferenceModelSpec
    from modelfleet.operator.reconcile.serving import render_manifest
    from modelfleet.operator.reconcile.traffic import VersionView, plan_traffic

    spec = InferenceModelSpec.model_validate(fleet.im["spec"])
    views = {
        o["spec"]["version"]: VersionView(
            name=o["spec"]["version"],
            resource_name=name,
            phase="Ready" if o is mv else "Converting",
            quantization=artifact["dtype"] if o is mv else o["spec"].get("quantization", "none"),
            artifacts=[artifact] if o is mv else [],
        )
        for name, o in fleet.mvs.items()
    }
    planned = plan_traffic(spec, views, settings)
    manifest = render_manifest(fleet.im["metadata"]["name"], spec, planned)
    for model in manifest.models:
        for version in model.versions:
            version.artifact = local.path(version.artifact)
    return manifest, planned


def start_server(fleet: Fleet, manifest, local: Local, settings) -> tuple[Server, str]:
    from modelfleet.operator.api import InferenceModelSpec
    from modelfleet.operator.reconcile import serving

    path = Path(local.path(f"{serving.MANIFEST_DIR}/{serving.MANIFEST_FILE}"))
    path.write_text(manifest.to_yaml())
    deployment = serving.deployment(fleet.im, InferenceModelSpec.model_validate(fleet.im["spec"]), settings)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    if container["command"] != ["modelfleet", "serve"]:
        raise StepFailed("serve-ready", f"the Deployment runs {container['command']}, not modelfleet serve")
    args = [local.path(a) for a in container["args"]]
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    env = {**os.environ, **local.env(container, pod_name=f"{deployment['metadata']['name']}-local")}
    server = Server([*MODELFLEET, "serve", *args], env, local.work / "logs" / "serve.log")
    return server, f"http://127.0.0.1:{port}"


def wait_ready(server: Server, url: str, timeout: float) -> float:
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if server.proc.poll() is not None:
            raise StepFailed("serve-ready", f"the server exited ({server.proc.returncode}):\n{server.tail()}")
        try:
            answer = httpx.get(f"{url}/ready", timeout=5)
        except httpx.HTTPError:
            answer = None  # not listening yet
        if answer is not None and answer.status_code == 200:
            return time.monotonic() - started
        failed = [v for v in _versions(answer) if v.get("state") == "failed"]
        if failed:  # a version that failed to load is not retried for a while: say why now
            reasons = "; ".join(f"{v.get('model')}@{v.get('version')}: {v.get('error')}" for v in failed)
            raise StepFailed("serve-ready", f"a version failed to load: {reasons}")
        time.sleep(1)
    raise StepFailed(
        "serve-ready", f"/ready not 200 after {timeout:.0f} s (log: {server.log}):\n{server.tail()}"
    )


def _versions(answer: Any) -> list[dict[str, Any]]:
    """The versions /ready lists (with their load state), or none where it answered no JSON."""
    try:
        versions = answer.json().get("versions", []) if answer is not None else []
    except ValueError:
        return []
    return [v for v in versions if isinstance(v, dict)]


def chat_body(model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,  # a random-weight model may end at once; the count must be exact
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def check_version(step: str, headers, expected: str) -> str:
    got = headers.get(VERSION_HEADER)
    if got != expected:
        raise StepFailed(step, f"{VERSION_HEADER} is {got!r}, expected {expected!r}")
    return got


def check_answer(step: str, text: Any, finish: Any, usage: Any, problems: list[str]) -> None:
    """What both chat steps require of an answer (besides `problems`, the step's own): some text, cut
    off by max_tokens, with usage counting exactly those tokens."""
    if not isinstance(text, str) or not text.strip():
        problems.append(f"content {text!r}")
    if finish != "length":
        problems.append(f"finish_reason {finish!r}")
    if not isinstance(usage, dict) or usage.get("completion_tokens") != MAX_TOKENS:
        problems.append(f"usage {usage}")
    if problems:
        raise StepFailed(step, "; ".join(problems))


def chat(url: str, model: str, version: str) -> dict[str, Any]:
    import httpx

    started = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(model, False), timeout=120)
    if r.status_code != 200:
        raise StepFailed("chat", f"HTTP {r.status_code}: {r.text[:500]}")
    check_version("chat", r.headers, version)
    body = r.json()
    choice = body["choices"][0]
    text = choice["message"]["content"]
    problems = [] if body.get("object") == "chat.completion" else [f"object {body.get('object')!r}"]
    check_answer("chat", text, choice.get("finish_reason"), body.get("usage"), problems)
    return {
        "version": version,
        "text": text,
        "usage": body["usage"],
        "seconds": round(time.monotonic() - started, 3),
    }


def chat_stream(url: str, model: str, version: str) -> dict[str, Any]:
    import httpx

    started, first = time.monotonic(), None
    pieces, finish, usage, done, chunks = [], None, None, False, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(model, True), timeout=120) as r:
        if r.status_code != 200:
            raise StepFailed("chat-stream", f"HTTP {r.status_code}: {r.read()[:500]!r}")
        check_version("chat-stream", r.headers, version)
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if done:
                raise StepFailed("chat-stream", f"data after [DONE]: {data[:200]}")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            chunks += 1
            if chunk.get("object") != "chat.completion.chunk":
                raise StepFailed("chat-stream", f"chunk object {chunk.get('object')!r}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.monotonic()
                    pieces.append(content)
                finish = choice.get("finish_reason") or finish
    text = "".join(pieces)
    check_answer("chat-stream", text, finish, usage, [] if done else ["no [DONE]"])
    return {
        "version": version,
        "text": text,
        "chunks": chunks,
        "usage": usage,
        "firstTokenSeconds": round(first - started, 3) if first else None,
        "seconds": round(time.monotonic() - started, 3),
    }


def serve(fleet: Fleet, mv: dict[str, Any], converted: dict[str, Any], local: Local, settings, args) -> None:
    version, model = mv["spec"]["version"], fleet.im["metadata"]["name"]
    with at("serve-ready"):
        artifact = converted["artifact"]
        manifest, planned = serving_manifest(fleet, mv, artifact, local, settings)
        served = {p.name: p.weight for p in planned}
        if served.get(version) != 100:
            raise StepFailed("serve-ready", f"the operator would not serve {version} alone: {served}")
        started = time.monotonic()
        server, url = start_server(fleet, manifest, local, settings)
    try:
        with at("serve-ready"):
            ready = wait_ready(server, url, args.ready_timeout)
        emit("serve-ready", ok=True, seconds=round(ready, 1), traffic=served, log=str(server.log),
             artifact=manifest.models[0].versions[0].artifact, dtype=artifact["dtype"])  # fmt: skip
        with at("chat"):
            emit("chat", ok=True, **chat(url, model, version))
        with at("chat-stream"):
            emit("chat-stream", ok=True, **chat_stream(url, model, version))
    except BaseException:
        server.stop()
        raise
    stopping = time.monotonic()
    code = server.stop()
    if code is None:
        raise StepFailed("serve-stop", f"still running 60 s after SIGTERM; killed (log: {server.log})")
    # uvicorn re-raises the SIGTERM it caught once its shutdown is complete: -15 after that line is clean
    graceful = code == -signal.SIGTERM and "Application shutdown complete" in server.tail(10)
    if code != 0 and not graceful:
        raise StepFailed("serve-stop", f"exit code {code} after SIGTERM:\n{server.tail()}")
    emit("serve-stop", ok=True, exitCode=code, seconds=round(time.monotonic() - stopping, 1),
         totalSeconds=round(time.monotonic() - started, 1))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="llama-3.2-1b")
    parser.add_argument(
        "--device", default="cuda", help="where the preset is built (the servers pick theirs)"
    )
    parser.add_argument("-f", "--filename", type=Path, default=REPO / "examples" / "model.yaml")
    parser.add_argument(
        "--version", help="the ModelVersion to convert and serve (default: the quantized one)"
    )
    parser.add_argument("--dtype", action="append", choices=QUANTIZED, dest="dtypes", help="default: both")
    parser.add_argument("--serve", default="fp8", choices=(*QUANTIZED, "none"), help="the artifact to serve")
    parser.add_argument("--work-dir", type=Path, help="kept, and its preset reused (default: a temp folder)")
    parser.add_argument("--convert-timeout", type=float, default=1200.0)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    dtypes = args.dtypes or list(QUANTIZED)
    if args.serve != "none" and args.serve not in dtypes:
        parser.error(f"--serve {args.serve} needs --dtype {args.serve}")

    from modelfleet.operator.settings import OperatorSettings

    settings = OperatorSettings()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="quantized-e2e-"))
    failed: list[str] = []
    try:
        with at("setup"):  # the model.yaml and the work folder
            fleet = load_fleet(args.filename)
            mv = pick_version(fleet, args.version)
            local = Local(work.absolute(), settings)
        with at("build"):
            emit("build", ok=True, **build(args.preset, source_folder(local, mv, settings), args.device))
        results = {}
        for dtype in dtypes:
            with at(f"convert-{dtype}"):
                results[dtype] = convert(fleet, mv, dtype, local, settings, args.convert_timeout)
        failed += [f"convert-{d}" for d, r in results.items() if not r["ok"]]
        if args.serve != "none":
            if not results[args.serve]["ok"]:
                raise StepFailed(
                    "serve-ready", f"no {args.serve} artifact to serve (convert-{args.serve} failed)"
                )
            serve(fleet, mv, results[args.serve], local, settings, args)
    except StepFailed as exc:
        emit(exc.step, ok=False, error=str(exc))
        failed.append(exc.step)
    finally:
        keep = args.work_dir is not None or bool(failed)  # a failure's logs stay
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    emit("done", ok=not failed, failed=failed, workDir=str(work) if keep else None)
    if failed:
        print(f"error: failed steps: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
