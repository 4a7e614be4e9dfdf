"""Fuzzing the data plane's HTTP API from its own OpenAPI document: whatever a client sends, the answer is
never a 5xx, every refusal has the OpenAI error shape, and the server still serves a normal request
afterwards. Bounded (examples per operation) so that it stays part of `make test`."""

from __future__ import annotations

import httpx
import schemathesis
from fuzzing import fuzz


def openai_error_shape_and_no_5xx(case: schemathesis.Case, response: schemathesis.Response) -> None:
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], response.text
        assert isinstance(error["type"], str), response.text


def short_generations(case: schemathesis.Case) -> None:
    """Fuzz the parsing, not the tiny model's speed: long generations add nothing but minutes."""
    if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
        case.body["max_tokens"] = min(case.body["max_tokens"], 4)


def test_no_input_gets_a_5xx_and_the_server_serves_on(fleet):
    schema = schemathesis.openapi.from_url(f"{fleet.url}/openapi.json")
    fuzzed = fuzz(schema, openai_error_shape_and_no_5xx, max_examples=150, prepare=short_generations)
    assert "POST /v1/completions" in fuzzed and "POST /v1/chat/completions" in fuzzed
    body = {"model": "tiny", "prompt": "still fine", "max_tokens": 3, "ignore_eos": True}
    answer = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
