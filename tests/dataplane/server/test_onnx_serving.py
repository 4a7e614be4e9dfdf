"""Serving an ONNX artifact: the tiny demo model converted to float32 ONNX, served next to its torch
checkpoint by one live server, called with the official `openai` client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from modelfleet.converters.convert import Request, convert
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.onnx_engine import AsyncOnnxEngine
from modelfleet.dataplane.sampling_params import SamplingParams
from modelfleet.dataplane.server import loading
from modelfleet.dataplane.server.model_manager import VersionSpec
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import LiveServer, model_yaml

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def onnx_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("onnx-serving")
    out = root / "cpu-onnx-fp32"
    summary = convert(
        Request(str(tiny_model_dir), "cpu", out, format="onnx", dtype="fp32", cache_dir=root / "cache")
    )
    assert summary["ok"] and summary["format"] == "onnx"
    return out


@pytest.fixture(scope="module")
def server(onnx_dir: Path, tiny_model_dir: Path) -> Iterator[LiveServer]:
    manifest = ServingManifest.from_yaml(
        "models:\n"
        + model_yaml("tiny-onnx", f'{{name: onnx-v1, weight: 100, artifact: "{onnx_dir}", preload: true}}')
        + model_yaml(
            "tiny-torch", f'{{name: torch-v1, weight: 100, artifact: "{tiny_model_dir}", preload: true}}'
        )
    )
    live = LiveServer(ServerSettings(max_tokens_limit=2000), manifest).start()
    live.wait_ready()
    yield live
    live.stop()


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def greedy(client: openai.OpenAI, model: str, **extra):
    return client.completions.with_raw_response.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
        **extra,
    )


def test_loader_picks_the_onnx_engine(server: LiveServer, onnx_dir: Path):
    assert isinstance(server.engine("tiny-onnx", "onnx-v1"), AsyncOnnxEngine)
    assert not isinstance(server.engine("tiny-torch", "torch-v1"), AsyncOnnxEngine)
    spec = VersionSpec(
        model="m", version="v", artifact=str(onnx_dir), engine_config=(("max_model_len", "512"),)
    )
    assert loading.is_onnx_artifact(onnx_dir)
    assert loading.estimate_engine_bytes(spec) > (onnx_dir / "model.onnx.data").stat().st_size


def test_plain_completion_matches_torch_greedy(client: openai.OpenAI):
    raw = greedy(client, "tiny-onnx")
    assert raw.headers["x-modelfleet-version"] == "onnx-v1"
    answer = raw.parse()
    torch_answer = greedy(client, "tiny-torch").parse()
    choice, torch_choice = answer.choices[0], torch_answer.choices[0]
    assert answer.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert choice.logprobs.tokens == torch_choice.logprobs.tokens
    assert choice.text == torch_choice.text and choice.text
    for ours, theirs in zip(
        choice.logprobs.token_logprobs, torch_choice.logprobs.token_logprobs, strict=True
    ):
        assert ours == pytest.approx(theirs, abs=2e-2)  # two implementations of the same float32 math


def test_streamed_completion(client: openai.OpenAI):
    plain = greedy(client, "tiny-onnx").parse().choices[0].text
    raw = client.completions.with_raw_response.create(
        model="tiny-onnx",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-modelfleet-version"] == "onnx-v1"
    chunks = list(raw.parse())
    assert chunks  # tokens that pile up while the server is busy may share a chunk
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_sampling_with_seed_and_bad_params(client: openai.OpenAI):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model="tiny-onnx", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(3) == sample(3)
    assert len({sample(s) for s in range(4)}) > 1
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-onnx", prompt=PROMPT, max_tokens=2, top_p=1.5)
    assert "top_p" in info.value.body["message"]


async def test_engine_token_ids_stops_and_stats(server: LiveServer):
    onnx_engine = server.engine("tiny-onnx", "onnx-v1")
    torch_engine = server.engine("tiny-torch", "torch-v1")

    async def run(engine, params: SamplingParams, request_id: str) -> list:
        return [out async for out in engine.generate(PROMPT, params, request_id=request_id)]

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ours, theirs = await asyncio.gather(run(onnx_engine, params, "o1"), run(torch_engine, params, "t1"))
    tokens = ours[-1].token_ids
    assert tokens == theirs[-1].token_ids and len(tokens) == 10
    assert [t for out in ours for t in out.new_token_ids] == tokens  # incremental, one step each
    assert ours[-1].finished and not any(out.finished for out in ours[:-1])

    stop_at = tokens[3]
    stopped = await run(
        onnx_engine, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]), "o2"
    )
    assert (
        stopped[-1].finish_reason == "stop" and stopped[-1].token_ids == tokens[: tokens.index(stop_at) + 1]
    )

    with pytest.raises(ValueError, match="prompt"):
        await anext(onnx_engine.generate(list(range(600)), params, request_id="o3"))
    stats = onnx_engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


async def test_abort_ends_the_running_request(server: LiveServer):
    engine = server.engine("tiny-onnx", "onnx-v1")
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    outputs = []
    async for out in engine.generate(PROMPT, params, request_id="long"):
        outputs.append(out)
        if len(outputs) == 2:
            assert engine.stats().num_running == 1 and engine.stats().kv_cache_usage > 0
            engine.abort("long")
    assert outputs[-1].finish_reason == "abort" and len(outputs[-1].token_ids) < 400
