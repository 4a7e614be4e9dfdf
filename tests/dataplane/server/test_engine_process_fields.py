"""logit_bias and structured output through an engine in its own process (AsyncLLMProcess, as on a GPU
server; here on the CPU): the parameters cross the pipe, the grammar is built in the child, and a schema
the child cannot compile is still a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import LiveServer, engine_process_server, openai_client

SCHEMA = {
    "type": "object",
    "properties": {"n": {"enum": [1, 2, 3]}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, openai.OpenAI]]:
    with engine_process_server(ServerSettings(), tiny_model_dir) as live:
        assert isinstance(live.engine("tiny", "v1"), AsyncLLMProcess)
        yield live, openai_client(live)


def test_structured_output_in_the_engine_process(client):
    _, api = client
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    answer = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a number"}], max_tokens=50, response_format=fmt
    )
    assert json.loads(answer.choices[0].message.content)["n"] in (1, 2, 3)
    bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5, response_format=bad
        )


def test_logit_bias_in_the_engine_process(client):
    live, api = client
    answer = api.completions.create(
        model="tiny",
        prompt="Once",
        max_tokens=4,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].text == live.engine("tiny", "v1").tokenizer.decode([42] * 4)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        api.completions.create(model="tiny", prompt="Once", max_tokens=2, logit_bias={"999999": 1})


def test_structured_output_with_the_grammars_in_a_process_of_their_own(tiny_model_dir, monkeypatch):
    """The whole chain a GPU server runs: the server, its engine process, and that engine's grammar
    process (MODELFLEET_GRAMMARS=process asks for it on the CPU too), with the official client; streamed
    and not, and a schema the grammar process refuses is still a 400."""
    import psutil

    monkeypatch.setenv("MODELFLEET_GRAMMARS", "process")
    with engine_process_server(ServerSettings(), tiny_model_dir) as live:
        api = openai_client(live)
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
        messages = [{"role": "user", "content": "a number"}]
        answer = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=50, response_format=fmt
        )
        assert json.loads(answer.choices[0].message.content)["n"] in (1, 2, 3)
        stream = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=50, response_format=fmt, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert json.loads(text)["n"] in (1, 2, 3)
        engine = psutil.Process(live.engine("tiny", "v1")._process.pid)
        commands = [" ".join(child.cmdline()) for child in engine.children()]
        assert any("modelfleet.dataplane.engine.grammar_process" in command for command in commands)
        bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nonsense"}}}
        with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
            api.chat.completions.create(model="tiny", messages=messages, max_tokens=5, response_format=bad)
