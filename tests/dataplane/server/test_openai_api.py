"""The official `openai` client against a live server with the real engine and the tiny demo model."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion(client):
    raw = client.completions.with_raw_response.create(model="tiny", prompt="Once upon a time", max_tokens=5)
    answer = raw.parse()
    assert raw.headers["x-modelfleet-version"] in ("v1", "v2")
    assert answer.object == "text_completion"
    assert answer.model == "tiny"
    (choice,) = answer.choices
    assert choice.finish_reason in ("length", "stop")
    assert answer.usage.prompt_tokens > 0
    assert 1 <= answer.usage.completion_tokens <= 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_streaming_completion_matches_plain_with_seed(client):
    args = dict(model="tiny@v1", prompt="The weather is", max_tokens=8, temperature=0.8, seed=7)
    plain = client.completions.create(**args)
    stream = client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]


def test_sse_ends_with_done(fleet):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_chat_plain_and_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, user="alice")
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens > 10  # the chat template wrapped the messages
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    # Without include_usage no chunk carries usage (as OpenAI's stream).
    assert all(c.usage is None for c in chunks)


def test_n_logprobs_and_stop(client):
    answer = client.completions.create(model="tiny", prompt="a b c", max_tokens=4, n=3, logprobs=2, seed=1)
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    for choice in answer.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
        assert all(value <= 0 for value in lp.token_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    # A stop string ends the text just before its first occurrence.
    long = client.completions.create(
        model="tiny@v1", prompt="count", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    text = long.choices[0].text
    start = next(i for i in range(3, len(text) - 3) if text[i : i + 3].strip())
    stop = text[start : start + 3]
    cut = client.completions.create(
        model="tiny@v1",
        prompt="count",
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_models_list(client):
    ids = {m.id for m in client.models.list()}
    assert {"tiny", "tiny@v1", "tiny@v2", "lazy", "broken"} <= ids


def test_pin_returns_that_version(client):
    for version in ("v1", "v2"):
        raw = client.completions.with_raw_response.create(model=f"tiny@{version}", prompt="x", max_tokens=1)
        assert raw.headers["x-modelfleet-version"] == version


def test_errors_use_openai_error_body(client, fleet):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny@v9", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="word " * 600, max_tokens=1)
    assert "over the limit of 511" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    assert info.value.body["param"] == "max_tokens"
    assert "limit of 2000" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=600)
    assert "exceeds the model's context of 512 tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", echo=True)
    assert info.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)
    assert info.value.body["param"] == "messages"

    raw = httpx.post(
        f"{fleet.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400
    assert raw.json()["error"]["message"] == "request body is not valid JSON; send a JSON object"
    wrong_type = httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": "two"})
    assert wrong_type.status_code == 400
    assert wrong_type.json()["error"]["param"] == "n"
    # The server is still healthy after all that.
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices


def test_websocket_streams_tokens(fleet):
    from websockets.sync.client import connect

    url = fleet.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url) as socket:
        import json

        socket.send(json.dumps({"model": "tiny@v2", "prompt": "hello", "max_tokens": 4, "temperature": 0}))
        messages = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(json.loads(socket.recv(timeout=30)))
        assert messages[0]["type"] == "start" and messages[0]["version"] == "v2"
        assert messages[-1]["type"] == "done" and messages[-1]["usage"]["completion_tokens"] >= 1
        text = "".join(m["choices"][0]["text"] for m in messages if m["type"] == "chunk")
        # Greedy, so the streamed pieces join into exactly the text a plain request gets.
        plain = httpx.post(
            f"{fleet.url}/v1/completions",
            json={"model": "tiny@v2", "prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        ).json()
        assert text == plain["choices"][0]["text"]
        assert messages[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
        socket.send(json.dumps({"model": "nope", "prompt": "x"}))  # errors keep the socket open
        error = json.loads(socket.recv(timeout=30))
        assert error["type"] == "error" and error["error"]["code"] == "model_not_found"
        socket.send(
            json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        )
        assert json.loads(socket.recv(timeout=30))["type"] == "start"
