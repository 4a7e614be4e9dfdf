"""Malformed text and content parts get a 400 in the OpenAI error shape, and the connection stays usable."""

from __future__ import annotations

import httpx
import pytest

LONE_SURROGATE = '{"model": "tiny@v1", "max_tokens": 2, "prompt": "bad \\ud800 text"}'

CHAT_BODIES = [
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', "text"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}', "text"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}', "type"),
    ('{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}', "messages[0].content"),
]


def assert_openai_error(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_lone_surrogate_in_a_prompt_is_a_400_and_keeps_the_connection(fleet):
    with httpx.Client(base_url=fleet.url, timeout=30) as client:
        response = client.post(
            "/v1/completions", content=LONE_SURROGATE, headers={"content-type": "application/json"}
        )
        assert_openai_error(response)
        assert "prompt" in response.json()["error"]["message"]
        again = client.post("/v1/completions", json={"model": "tiny@v1", "prompt": "fine", "max_tokens": 2})
        assert again.status_code == 200
        assert response.headers.get("connection") != "close"


@pytest.mark.parametrize(("body", "named"), CHAT_BODIES)
def test_bad_chat_content_is_a_400_naming_the_part(fleet, body, named):
    content = body[:-1] + ', "model": "tiny@v1", "max_tokens": 2}'
    response = httpx.post(
        f"{fleet.url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_openai_error(response)
    error = response.json()["error"]
    assert named in f"{error['param']} {error['message']}"


def test_text_parts_are_joined(fleet):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    joined = {"model": "tiny@v1", "max_tokens": 4, "temperature": 0}
    as_parts = httpx.post(
        f"{fleet.url}/v1/chat/completions",
        json={**joined, "messages": [{"role": "user", "content": parts}]},
        timeout=30,
    )
    as_text = httpx.post(
        f"{fleet.url}/v1/chat/completions",
        json={**joined, "messages": [{"role": "user", "content": "Hello there"}]},
        timeout=30,
    )
    assert as_parts.status_code == as_text.status_code == 200
    message = as_parts.json()["choices"][0]["message"]["content"]
    assert message == as_text.json()["choices"][0]["message"]["content"]
