"""Request fields as OpenAI's API defines them, tried with the official `openai` client on a live server:
default max_tokens, `created`, usage in streams, logit_bias, and a 400 naming any field not implemented."""

from __future__ import annotations

import time

import openai
import pytest
import torch
from modelfleet.dataplane.engine.sampler import apply_logit_bias
from modelfleet.dataplane.sampling_params import SamplingParams

from tests.dataplane.server.conftest import TEST_ENGINE

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client):
    answer = client.chat.completions.create(
        model="tiny@v1", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == TEST_ENGINE["max_model_len"]


def test_completion_without_max_tokens_gets_16(client):
    answer = client.completions.create(model="tiny@v1", prompt="Once", extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16


def test_created_is_now_on_answers_chunks_and_models(client):
    before = int(time.time())
    answer = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, stream=True))
    models = client.models.list().data
    after = int(time.time())
    for created in [answer.created, *(c.created for c in chunks), *(m.created for m in models)]:
        assert isinstance(created, int) and before - 1 <= created <= after + 1


def test_usage_in_a_stream_only_when_asked(client):
    # all 4 tokens: the random model, sampling at OpenAI's default temperature, may otherwise stop early
    full = {"max_tokens": 4, "stream": True, "extra_body": {"ignore_eos": True}}
    plain = list(client.chat.completions.create(model="tiny", messages=MESSAGES, **full))
    assert plain[-1].choices and all(c.usage is None for c in plain)

    asked = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, stream_options={"include_usage": True}, **full
        )
    )
    *body, last = asked
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4
    assert all(c.usage is None and c.choices for c in body)


def test_logit_bias_forces_and_bans_tokens(client, fleet):
    tokenizer = fleet.engine("tiny", "v1").tokenizer
    args = dict(
        model="tiny@v1", prompt="The weather is", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    forced = client.completions.create(**args, logit_bias={"42": 100})
    assert forced.choices[0].text == tokenizer.decode([42] * 5)

    greedy = client.completions.create(**args, logprobs=0)
    first = greedy.choices[0].logprobs.tokens[0]
    first_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(first))[0]
    banned = client.completions.create(**args, logprobs=0, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    # chat takes it too
    chat = client.chat.completions.create(
        model="tiny@v1", messages=MESSAGES, max_tokens=3, temperature=0.9, logit_bias={"42": 100}
    )
    assert chat.choices[0].message.content == tokenizer.decode([42] * 3)


@pytest.mark.parametrize(
    ("bias", "says"),
    [({"99999999": 1}, "outside the vocabulary"), ({"5": 101}, "[-100, 100]"), ({"x": 1}, "integer")],
)
def test_bad_logit_bias_is_a_400_naming_it(client, bias, says):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, logit_bias=bias)
    message = caught.value.body["message"]
    assert message.startswith("logit_bias") and says in message


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # the deprecated form of tools
        ({"tool_choice": "always"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"modalities": ["audio"]}, "modalities"),
    ],
)
def test_unsupported_chat_fields_are_a_400_naming_them(client, extra, field):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == field
    assert field.split(".")[0] in caught.value.body["message"]


def test_unsupported_completion_fields_are_a_400(client):
    for extra in ({"best_of": 2}, {"suffix": "end"}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == next(iter(extra))


def test_harmless_fields_are_accepted(client):
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        user="alice",
        metadata={"team": "a"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=False,
        response_format={"type": "text"},
        tool_choice="none",
        stream_options=None,
    )
    assert answer.usage.completion_tokens == 2


def test_logit_bias_rows_leave_the_fused_path_and_only_touch_their_row():
    assert SamplingParams().temperature_only
    assert not SamplingParams(logit_bias={3: 1.5}).temperature_only
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 150.0})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={10: 1.0}).check_vocab(10)
    logits = torch.zeros(2, 6)
    biased = apply_logit_bias(logits, [SamplingParams(logit_bias={1: 2.0, 4: -100.0}), SamplingParams()])
    assert biased[0].tolist() == [0.0, 2.0, 0.0, 0.0, -100.0, 0.0]
    assert biased[1].tolist() == [0.0] * 6
