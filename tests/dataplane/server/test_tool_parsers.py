"""The tool-call parsers on fixed texts, in the formats chat templates teach (a tiny model with random
weights never writes them), whole and streamed in every split."""

from __future__ import annotations

import json

import pytest
from modelfleet.dataplane.server.tools import ToolStream, parse_forced, parse_tool_calls

NAMES = {"get_weather", "get_time"}


def calls_of(text: str):
    content, calls = parse_tool_calls(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_after_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    )
    assert calls_of(text) == (
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    )


def test_hermes_unclosed_last_block_still_parses():
    assert calls_of('<tool_call>{"name": "get_time", "arguments": {}}') == (None, [("get_time", {})])


def test_llama_json_with_parameters_python_tag_and_separator():
    assert calls_of('{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (
        None,
        [("get_weather", {"city": "Oslo"})],
    )
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "A"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    assert calls_of(text) == (None, [("get_weather", {"city": "A"}), ("get_time", {})])


def test_arguments_sent_as_a_json_string_are_read():
    text = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
    assert calls_of(text) == (None, [("get_weather", {"city": "Rome"})])


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice.",
        '{"name": "delete_everything", "parameters": {}}',  # not a tool the request offered
        '{"name": "get_weather", "parameters": [1, 2]}',  # arguments not an object
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '{"city": "Paris"}',  # JSON, but no call
        '{"name": "get_weather", "parameters": {}} and some words',
    ],
)
def test_anything_else_stays_content(text):
    assert calls_of(text) == (text, [])


def test_call_ids_are_unique():
    _, calls = parse_tool_calls(
        '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}', NAMES
    )
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def stream(text: str, size: int):
    s = ToolStream(NAMES)
    sent = "".join(s.feed(text[i : i + size]) for i in range(0, len(text), size))
    rest, calls = s.finish()
    return sent, rest, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_content_then_call(size):
    text = 'Sure: <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    sent, rest, calls = stream(text, size)
    assert sent + rest == "Sure: " and calls == [("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_llama_call_sends_no_content(size):
    sent, rest, calls = stream('  {"name": "get_weather", "parameters": {"city": "Lima"}}', size)
    assert (sent, rest, calls) == ("", "", [("get_weather", {"city": "Lima"})])


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_plain_text_all_arrives_and_a_lookalike_is_released(size):
    text = "a < b and <tool is not a call; {braces} too"
    sent, rest, calls = stream(text, size)
    assert sent + rest == text and calls == []
    if size == 1:
        assert len(sent) >= len(text) - len("<tool_call>")  # only a possible marker is held back


def test_streamed_broken_call_comes_back_as_content():
    text = '{"name": "get_weather", "parameters": {"city": '
    assert stream(text, 3) == ("", text, [])


def test_forced_answers_parse_as_calls_or_stay_content():
    args = '{"city": "Paris"}'
    (call,) = parse_forced(args, "get_weather", NAMES)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    calls = parse_forced(
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {}}]', "*", NAMES
    )
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse_forced('{"city": "Par', "get_weather", NAMES) == []  # cut short by max_tokens
    assert parse_forced('[{"name": "rm_rf", "parameters": {}}]', "*", NAMES) == []
    stream = ToolStream(NAMES, forced="get_weather")
    assert stream.feed(args[:5]) == "" and stream.feed(args[5:]) == ""
    assert [(c.name, c.arguments) for c in stream.finish()[1]] == [("get_weather", '{"city": "Paris"}')]
