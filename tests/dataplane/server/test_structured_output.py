"""response_format json_object / json_schema on a live server with the tiny model: its weights are
random, so whatever valid JSON it writes is the grammar's doing."""

from __future__ import annotations

import json

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Pick a color."}]


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_follows_the_schema(client, seed):
    answer = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        seed=seed,
        max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    assert set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue")
    assert isinstance(value["ok"], bool)


def test_json_schema_streams_too(client):
    chunks = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        seed=4,
        max_tokens=100,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(text)["color"] in ("red", "green", "blue")


def test_json_object_starts_an_object(client):
    answer = client.chat.completions.create(
        model="tiny", messages=ASK, seed=5, max_tokens=30, response_format={"type": "json_object"}
    )
    text = answer.choices[0].message.content
    assert text.lstrip().startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_unconstrained_output_is_not_json(client):
    """The same request without response_format: the tiny model writes no JSON of its own."""
    answer = client.chat.completions.create(model="tiny", messages=ASK, seed=1, max_tokens=20)
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.choices[0].message.content)


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, None),
    ],
)
def test_bad_formats_are_a_400(client, response_format, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=5, response_format=response_format
        )
    assert caught.value.body["param"] == param
    assert "response_format" in caught.value.body["message"] or "json_schema" in caught.value.body["message"]


def test_a_bad_schema_beside_a_stream_loses_nothing(client):
    """A schema refused (400) while another request streams: that stream runs to its end untouched."""
    stream = client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, response_format=bad)
    assert "cannot be compiled" in caught.value.body["message"]
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


def test_ignore_eos_with_a_schema_is_a_400_naming_it(client):
    """Past the end of its JSON a grammar allows no token but the end: ignoring it cannot be honoured."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
            extra_body={"ignore_eos": True},
        )
    assert caught.value.body["param"] == "ignore_eos"
