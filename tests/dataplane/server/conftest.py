"""Live servers for the end-to-end tests: the real engine with the tiny demo models, served by uvicorn on
a free port in a background thread, so tests can also look at the server's state (engine KV blocks,
spans in an in-memory exporter)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import uvicorn
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.server import loading
from modelfleet.dataplane.server.dataplane import DataPlane
from modelfleet.dataplane.server.runtime import build_app
from modelfleet.dataplane.server.settings import ServerSettings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# Small KV cache and context: fast to allocate, and a context limit that tests can exceed.
TEST_ENGINE = {"kv_cache_bytes": 8_000_000, "max_model_len": 512, "max_num_seqs": 32}


def model_yaml(name: str, *versions: str) -> str:
    """One model entry of a serving manifest's `models:` list, with the test engine settings; each version
    is a YAML flow mapping."""
    engine = ", ".join(f"{k}: {v}" for k, v in TEST_ENGINE.items())
    listed = "".join(f"      - {v}\n" for v in versions)
    return f"  - name: {name}\n    engine: {{{engine}}}\n    versions:\n{listed}"


class LiveServer:
    def __init__(
        self,
        settings: ServerSettings,
        manifest: ServingManifest,
        *,
        manifest_path: Path | None = None,
        **app_options,  # e.g. loader=: a stand-in engine for paths a tiny model cannot be made to take
    ):
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.app = build_app(
            settings, manifest, manifest_path=manifest_path, tracer=provider.get_tracer("test"), **app_options
        )
        self.dataplane: DataPlane = self.app.state.dataplane
        self.manifest_path = manifest_path
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while (response := httpx.get(f"{self.url}/ready")).status_code != 200:
            failed = [v for v in response.json()["versions"] if v["preload"] and v["state"] == "failed"]
            if failed:
                raise RuntimeError(f"a preloaded version failed: {failed[0]['error']}")
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not become ready")
            time.sleep(0.05)

    def engine(self, model: str, version: str):
        slot = self.dataplane.manager.slots[(model, version)]
        return slot.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def one_version_yaml(artifact: Path, version: str = "v1") -> str:
    """A serving manifest of model `tiny` with one preloaded version taking all traffic."""
    entry = f'{{name: {version}, weight: 100, artifact: "{artifact}", preload: true}}'
    return "models:\n" + model_yaml("tiny", entry)


@contextmanager
def engine_process_server(
    settings: ServerSettings,
    artifact: Path,
    *,
    manifest_path: Path | None = None,
    server_class: type[LiveServer] = LiveServer,
) -> Iterator[LiveServer]:
    """A started, ready server of `one_version_yaml(artifact)` whose loader believes a GPU is present, so
    that its engine runs in a process of its own (AsyncLLMProcess; the child then picks the CPU itself).
    With `manifest_path` the manifest is written there and watched."""
    text = one_version_yaml(artifact)
    if manifest_path is not None:
        manifest_path.write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "torch_cuda_available", lambda: True)
        live = server_class(settings, ServingManifest.from_yaml(text), manifest_path=manifest_path).start()
        try:
            live.wait_ready()
            yield live
        finally:
            live.stop()


def openai_client(live: LiveServer, timeout: float = 60) -> openai.OpenAI:
    """The official client for `live`'s OpenAI API, without retries: a failure shows at once."""
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=timeout)


def manifest_yaml(v1: Path, v2: Path, *, w1: int, w2: int, extra: str = "") -> str:
    engine = ", ".join(f"{k}: {v}" for k, v in TEST_ENGINE.items())
    return f"""
models:
  - name: tiny
    engine: {{{engine}}}
    routing: {{stickyBy: user}}
    versions:
      - {{name: v1, weight: {w1}, artifact: "{v1}", preload: true}}
      - {{name: v2, weight: {w2}, artifact: "{v2}", preload: true}}
{extra}"""


@pytest.fixture(scope="session")
def tiny_model_v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from modelfleet.dataplane.demo import create_demo_model

    return create_demo_model(tmp_path_factory.mktemp("demo-v2") / "tiny-v2", size="tiny", seed=1)


@pytest.fixture(scope="session")
def fleet(tiny_model_dir, tiny_model_v2_dir, tmp_path_factory) -> Iterator[LiveServer]:
    """One server for most end-to-end tests: model `tiny` with two preloaded versions (50/50, sticky by
    user), a lazy model `lazy`, a model `shadowed` mirroring all traffic to a second version, and a model
    `broken` whose artifact does not exist."""
    engine = ", ".join(f"{k}: {v}" for k, v in TEST_ENGINE.items())
    extra = f"""
  - name: lazy
    engine: {{{engine}}}
    versions:
      - {{name: only, weight: 100, artifact: "{tiny_model_dir}"}}
  - name: shadowed
    engine: {{{engine}}}
    versions:
      - {{name: a, weight: 100, artifact: "{tiny_model_dir}"}}
      - {{name: b, weight: 0, artifact: "{tiny_model_v2_dir}", shadow_percent: 100}}
  - name: broken
    versions:
      - {{name: v1, weight: 100, artifact: "{tiny_model_dir.parent / "missing"}"}}
"""
    path = tmp_path_factory.mktemp("fleet") / "manifest.yaml"
    path.write_text(manifest_yaml(tiny_model_dir, tiny_model_v2_dir, w1=50, w2=50, extra=extra))
    settings = ServerSettings(manifest_poll_seconds=0.1, max_tokens_limit=2000, load_retry_seconds=60)
    server = LiveServer(settings, ServingManifest.from_yaml(path.read_text()), manifest_path=path)
    server.extra_manifest = extra
    server.start()
    server.wait_ready()
    yield server
    server.stop()
