"""Tool calling through a live server with the official `openai` client. A tiny model with random weights
never writes a tool call, so a stand-in engine answers with a fixed text (the real tokenizer, with a
chat template that prints the tools): what is tested is the server's side, the tools reaching the
template, the model's text parsed into `tool_calls`, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.manifest import single_model_manifest
from modelfleet.dataplane.server.settings import ServerSettings
from transformers import AutoTokenizer

from tests.dataplane.server.conftest import LiveServer

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedEngine:
    """Answers every request with `script`, a few characters per step; keeps each prompt as text."""

    def __init__(self, model_dir) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.chat_template = TEMPLATE
        self.limits = SimpleNamespace(max_num_seqs=8, max_model_len=512, vocab_size=len(self.tokenizer))
        self.max_model_len, self.config = 512, SimpleNamespace(max_num_seqs=8)
        self.failure, self.on_failure = None, None
        self.script, self.prompts = "", []

    async def generate(self, prompt, params, request_id=None, priority=0):
        self.prompts.append(self.tokenizer.decode(prompt))
        pieces = [self.script[i : i + 3] for i in range(0, len(self.script), 3)][: params.max_tokens]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = i == len(pieces) - 1
            yield RequestOutput(
                request_id,
                [],
                text=piece,
                token_ids=[1],
                new_text=piece,
                new_token_ids=[1],
                finish_reason="stop" if last else None,
                finished=last,
                delta=True,
            )

    async def abort(self, request_id):
        pass

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0.0, 100, 100)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = ScriptedEngine(tiny_model_dir)
    manifest = single_model_manifest(tiny_model_dir, name="tools")
    server = LiveServer(ServerSettings(), manifest, loader=lambda spec: engine, estimate_bytes=lambda spec: 0)
    server.start()
    server.wait_ready()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    yield engine, client
    server.stop()


def test_a_hermes_call_after_content(served):
    engine, client = served
    engine.script = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    answer = client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER], max_tokens=200)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools reached the chat template
    assert '"name": "get_weather"' in engine.prompts[-1] and "Current weather of a city" in engine.prompts[-1]


def test_a_streamed_llama_json_call(served):
    engine, client = served
    engine.script = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    chunks = list(
        client.chat.completions.create(
            model="tools", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=200, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    (call,) = deltas
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_plain_text_with_tools_arrives_whole(served):
    engine, client = served
    engine.script = "It is sunny in Paris, 21 degrees. <b>Enjoy</b>"
    chunks = list(
        client.chat.completions.create(
            model="tools", messages=ASK, tools=[WEATHER], max_tokens=200, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == engine.script
    assert all(c.choices[0].delta.tool_calls is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice_none_and_no_tools_leave_the_text_alone(served):
    engine, client = served
    engine.script = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for extra in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        answer = client.chat.completions.create(model="tools", messages=ASK, max_tokens=200, **extra)
        assert answer.choices[0].message.content == engine.script
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"
        assert "Tools:" not in engine.prompts[-1]  # nothing offered, nothing in the prompt


def test_earlier_calls_and_results_reach_the_template(served):
    engine, client = served
    engine.script = "Sunny, 21 degrees."
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER], max_tokens=50)
    assert answer.choices[0].message.content == "Sunny, 21 degrees."
    prompt = engine.prompts[-1]
    # the arguments reach the template as an object (templates print them with tojson)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert '<|im_start|>tool\n{"temp": 21}' in prompt


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "any"}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather", "x": 1}}},
            "tool_choice",
        ),
        (
            {"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]},
            "tools.0.function.strict",
        ),
        ({"tools": [WEATHER, WEATHER]}, None),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ],
)
def test_what_is_not_supported_is_a_400(served, extra, param):
    _, client = served
    body = {"tools": [WEATHER], **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tools", messages=ASK, max_tokens=5, extra_body=body)
    assert caught.value.body["param"] == param
    assert (param or "tools").split(".")[0] in caught.value.body["message"]


def test_tokenize_counts_the_tools_the_template_prints(served):
    engine, client = served
    base = str(client.base_url).removesuffix("/v1/")
    body = {"model": "tools", "messages": ASK}
    plain = httpx.post(f"{base}/tokenize", json=body).json()
    with_tools = httpx.post(f"{base}/tokenize", json={**body, "tools": [WEATHER]}).json()
    shown = engine.tokenizer.apply_chat_template(
        ASK, tools=[WEATHER], add_generation_prompt=True, tokenize=True
    )
    assert with_tools["count"] == len(shown["input_ids"]) > plain["count"]
