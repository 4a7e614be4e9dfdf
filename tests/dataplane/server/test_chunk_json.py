"""A streamed chunk's JSON from its template (Renderer.stream_json) is the same text as the chunk's pydantic
model dumps: for every character a token's text can hold, odd model names, each finish reason and choice
index; requests whose chunks carry more than text (logprobs, tools) take the models' own path."""

from __future__ import annotations

import json
import random

import pytest
from modelfleet.dataplane.server.engine_io import ChoiceEvent
from modelfleet.dataplane.server.protocol import ChatCompletionRequest, CompletionRequest
from modelfleet.dataplane.server.render import ChatRenderer, ChunkTemplate, CompletionRenderer

# every code point but the surrogates, which no decoded text holds (and pydantic refuses to encode)
EVERY_CHARACTER = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
MODELS = ["tiny", 'm"od\\el', "modèle\u2028中文🙂", "tab\there\x00\x1f\x7f"]
REASONS = [None, "stop", "length", "abort", "tool_calls"]


class WordTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f" w{i}" for i in ids)


def texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    specials = ['"', "\\", "\n", "\r", "\t", "\b", "\f", "\x00", "\x1f", "\x7f", "é", "\u2028", "🙂", "/"]
    out = ["", " t1", EVERY_CHARACTER]
    for _ in range(200):
        pool = [*specials, "a", " ", chr(rng.randrange(0x20, 0xD800))]
        out.append("".join(rng.choice(pool) for _ in range(rng.randrange(1, 12))))
    return out


def completion(model: str, **fields) -> CompletionRenderer:
    return CompletionRenderer(CompletionRequest(model=model, prompt="hi", **fields))


def chat(model: str, **fields) -> ChatRenderer:
    messages = [{"role": "user", "content": "hi"}]
    return ChatRenderer(ChatCompletionRequest(model=model, messages=messages, **fields))


def twins(make, model: str, **fields):
    """Two renderers of one request: one streams, the other adds and renders the models."""
    ours, twin = make(model, **fields), make(model, **fields)
    twin.response_id, twin.created = ours.response_id, ours.created
    return ours, twin


def model_json(renderer, event: ChoiceEvent) -> str:
    renderer.add(event)
    return renderer.chunk(event, WordTokenizer()).model_dump_json()


@pytest.mark.parametrize("make", [completion, chat])
@pytest.mark.parametrize("model", MODELS)
def test_template_writes_the_models_json(make, model):
    ours, twin = twins(make, model, n=4)
    for i, text in enumerate(texts(len(model))):
        reason = REASONS[i % len(REASONS)]
        event = ChoiceEvent(index=i % 4, new_text=text, new_token_ids=(1,) * (i % 3), finish_reason=reason)
        assert ours.stream_json(event, WordTokenizer()) == model_json(twin, event)
    assert sorted(ours._templates) == [0, 1, 2, 3]
    assert all(template is not None for template in ours._templates.values())
    # what the request's end reads: its tokens and finish reasons, and the usage chunk
    assert ours.completion_tokens == twin.completion_tokens > 0
    assert ours.finish_reasons() == twin.finish_reasons()
    assert ours.usage_chunk().model_dump_json() == twin.usage_chunk().model_dump_json()


def test_text_with_every_character_round_trips():
    event = ChoiceEvent(index=0, new_text=EVERY_CHARACTER, new_token_ids=(1,))
    assert json.loads(completion("tiny").stream_json(event, None))["choices"][0]["text"] == EVERY_CHARACTER


@pytest.mark.parametrize(
    ("make", "fields"),
    [
        (completion, {"logprobs": 2}),
        (chat, {"logprobs": True, "top_logprobs": 1}),
        (chat, {"tools": [{"type": "function", "function": {"name": "get_weather"}}]}),
    ],
)
def test_chunks_with_more_than_text_take_the_models_path(make, fields):
    ours, twin = twins(make, "tiny", **fields)
    for i, text in enumerate(["Hello", ' "there"', "\n", ""]):
        reason = "stop" if text == "" else None
        event = ChoiceEvent(0, text, (i,), logprobs=({i: -0.5, 7: -1.0},), finish_reason=reason)
        assert ours.stream_json(event, WordTokenizer()) == model_json(twin, event)
    assert ours._templates == {0: None}
    assert ours.choices[0] == twin.choices[0]  # the models' path keeps the whole choice


def test_a_chunk_that_hides_a_field_is_refused():
    def build(text, reason):  # a chunk whose dump does not carry the text where a template would put it
        return CompletionRequest(model="tiny", prompt="x")

    with pytest.raises(AssertionError, match="once each"):
        ChunkTemplate.of(build)
