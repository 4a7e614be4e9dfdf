"""`/tokenize`, `/detokenize` and `/version` on a live server (vLLM's shapes; the `openai` client has no
methods for them, so plain HTTP), checked against the model's tokenizer and the chat endpoint's usage."""

from __future__ import annotations

import importlib.metadata

import httpx
import openai
import pytest

from tests.dataplane.server.conftest import TEST_ENGINE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def post(fleet, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{fleet.url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_as_the_model_does(fleet):
    tokenizer = fleet.engine("tiny", "v1").tokenizer
    answer = post(
        fleet, "/tokenize", {"model": "tiny@v1", "prompt": "The weather is fine", "return_token_strs": True}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == tokenizer.encode("The weather is fine")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == TEST_ENGINE["max_model_len"]
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


def test_tokenize_messages_counts_what_chat_charges(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="tiny@v1", messages=MESSAGES, max_tokens=1)
    body = post(fleet, "/tokenize", {"model": "tiny@v1", "messages": MESSAGES}).json()
    assert body["count"] == chat.usage.prompt_tokens
    without = post(
        fleet, "/tokenize", {"model": "tiny@v1", "messages": MESSAGES, "add_generation_prompt": False}
    )
    assert without.json()["count"] < body["count"]


def test_detokenize_round_trip(fleet):
    tokens = post(fleet, "/tokenize", {"model": "tiny", "prompt": "round trip", "add_special_tokens": False})
    answer = post(fleet, "/detokenize", {"model": "tiny", "tokens": tokens.json()["tokens"]})
    assert answer.status_code == 200 and answer.json() == {"prompt": "round trip"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "tiny", "prompt": "a", "messages": MESSAGES}, 400, None),
        ("/tokenize", {"model": "tiny"}, 400, None),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"model": "tiny", "prompt": "a", "truncate": 3}, 400, "truncate"),
        ("/detokenize", {"model": "tiny", "tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": ["a"]}, 400, "tokens.0"),
    ],
)
def test_bad_requests_say_why(fleet, path, body, status, param):
    answer = post(fleet, path, body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["param"] == param and error["message"]


def test_version(fleet):
    answer = httpx.get(f"{fleet.url}/version")
    assert answer.status_code == 200
    assert answer.json() == {"version": importlib.metadata.version("modelfleet")}
