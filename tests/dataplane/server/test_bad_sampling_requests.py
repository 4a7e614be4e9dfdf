"""Through the live server: a request whose sampling values would overflow in the engine gets a 400 in the
OpenAI error shape naming the parameter, and the stream already running beside it finishes normally."""

from __future__ import annotations

import httpx
import pytest

BAD = [
    ({"seed": 1 << 64}, "seed"),
    ({"seed": -(1 << 63) - 1}, "seed"),
    ({"top_k": 1 << 63}, "top_k"),
    ({"logprobs": 1 << 63}, "logprobs"),
]


@pytest.mark.parametrize(("fields", "name"), BAD)
def test_overflowing_sampling_values_fail_only_their_own_request(fleet, fields, name):
    running = {"model": "tiny@v1", "prompt": "keep going", "max_tokens": 40, "ignore_eos": True}
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json={**running, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # the first stream is in the engine
        bad = httpx.post(
            f"{fleet.url}/v1/completions",
            json={"model": "tiny@v1", "prompt": "bad", "max_tokens": 4, "temperature": 1.0, **fields},
            timeout=30,
        )
        rest = [line for line in lines if line.startswith("data: ")]
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert name in error["message"]
    assert rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line.replace(" ", "") for line in rest)
