"""A GPU server runs each torch engine in its own process (AsyncLLMProcess): served end to end here on
the CPU by making the loader believe a GPU is present (the child then picks the CPU itself)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess
from modelfleet.dataplane.server import loading
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import TEST_ENGINE, LiveServer, engine_process_server, openai_client


@pytest.mark.parametrize(
    ("device", "cuda", "expected"),
    [
        (None, True, True),
        (None, False, False),
        ("auto", True, True),
        ("cuda:1", True, True),
        ("cpu", True, False),
    ],
)
def test_gpu_engines_get_their_own_process(device, cuda, expected):
    assert loading.engine_in_own_process(device, cuda) is expected


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with engine_process_server(ServerSettings(), tiny_model_dir) as live:
        yield live


def test_streamed_and_whole_completions_equal_the_engine(server: LiveServer, tiny_model_dir: Path):
    engine = server.engine("tiny", "v1")
    assert isinstance(engine, AsyncLLMProcess) and engine._process.is_alive()
    client = openai_client(server)
    body = dict(
        model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**body)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **body) if c.choices)
    settings = dict(TEST_ENGINE)
    want = LLM(tiny_model_dir, device="cpu", **settings).generate(
        "Once upon a time", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )[0]
    assert whole.choices[0].text == streamed == want.text and whole.usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=list(range(5, 600)), max_tokens=4)


def test_a_crashed_engine_process_is_started_again_by_the_next_request(server: LiveServer):
    engine = server.engine("tiny", "v1")
    os.kill(engine._process.pid, signal.SIGKILL)
    engine._thread.join(timeout=30)  # its reader has seen the end
    assert engine.failure is not None
    client = openai_client(server, timeout=120)
    answer = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4
    fresh = server.engine("tiny", "v1")
    assert fresh is not engine and fresh._process.is_alive() and fresh.failure is None
