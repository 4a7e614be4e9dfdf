"""tool_choice "required" and a named function, on a live server with the tiny model: decoding is
constrained to the calls' JSON, so even random weights answer with well-formed calls to offered tools."""

from __future__ import annotations

import json

import openai
import pytest


def tool(name: str, properties: dict) -> dict:
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": schema}}


WEATHER = tool("get_weather", {"city": {"enum": ["Paris", "Oslo"]}})
TIME = tool("get_time", {"utc": {"type": "boolean"}})
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_named_function_is_called(client, seed):
    answer = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        seed=seed,
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_required_gives_one_call_or_more_to_offered_tools(client, seed):
    answer = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        seed=seed,
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls  # parallel_tool_calls=False: exactly one
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"utc"}))


def test_required_streams_its_calls(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            seed=6,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert calls and all(d.function.name == "get_weather" for d in calls)
    assert [d.index for d in calls] == list(range(len(calls)))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"tool_choice": "required"}, "no tools are given"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
    ],
)
def test_forced_choices_that_cannot_be_met_are_a_400(client, extra, says):
    with pytest.raises(openai.BadRequestError, match=says):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, extra_body=extra)
