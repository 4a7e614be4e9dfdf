"""The completion routes parse a well-formed JSON body themselves (app.JsonBodyRoute) and leave every
other request to FastAPI: both ways give the same answers and the same errors."""

from __future__ import annotations

import json

import httpx
import pytest
from modelfleet.dataplane.server.app import create_app

from tests.dataplane.server.test_dataplane import traced_dataplane

COMPLETION = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "seed": 5}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# FastAPI parses a `+json` type as JSON; the routes' own parsing takes application/json alone.
FASTAPI_ONLY = "application/merge-patch+json"


@pytest.fixture
async def served():
    """The app and how many times a request's key was checked (once by the guard; FastAPI's dependency
    checks it again)."""
    dp, exporter = traced_dataplane()
    checks: list[int] = []
    refresh = dp.keys.refresh

    def counted_refresh() -> None:
        checks.append(1)
        refresh()

    dp.keys.refresh = counted_refresh  # type: ignore[method-assign]
    transport = httpx.ASGITransport(app=create_app(dp))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http, checks, exporter
    await dp.close()


async def post(http: httpx.AsyncClient, path: str, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    return await http.post(path, content=body, headers=headers)


def answer(response: httpx.Response) -> tuple[int, str, list]:
    """Status, version header, and the body with its per-request id and time left out."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        body = [json.loads(e) if e != "[DONE]" else e for e in events]
    else:
        body = [response.json()]
    for item in body:
        if isinstance(item, dict):
            item.pop("id", None), item.pop("created", None)
    return response.status_code, response.headers.get("x-modelfleet-version", ""), body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "request_body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
async def test_a_well_formed_request_takes_the_short_way_and_answers_the_same(
    served, path, request_body, stream
):
    http, checks, exporter = served
    body = json.dumps({**request_body, "stream": stream}).encode()
    short = await post(http, path, body, "application/json; charset=utf-8")
    assert len(checks) == 1  # the guard's check alone: FastAPI's dependency did not run
    checks.clear()
    full = await post(http, path, body, FASTAPI_ONLY)
    assert len(checks) == 2
    assert answer(short) == answer(full)
    assert short.status_code == 200
    spans = [s for s in exporter.get_finished_spans() if s.name == f"POST {path}"]
    assert [s.attributes["http.response.status_code"] for s in spans] == [200, 200]


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"model": "m", "prompt": [1, 2]', "application/json"),  # not valid JSON
        (b'["m"]', "application/json"),  # not an object
        (b'{"model": "m"}', "application/json"),  # no prompt
        (b'{"model": "m", "prompt": [1], "echo": true}', "application/json"),  # refused by the model
        (b'{"model": "m", "prompt": "a\\ud800"}', "application/json"),  # a lone surrogate
        (b'{"model": "m", "prompt": [1]}', "text/plain"),  # not JSON by its type
        (b'{"model": "m", "prompt": [1]}', None),  # no type
        (b"", "application/json"),  # no body
    ],
)
async def test_a_request_the_short_way_refuses_gets_fastapis_answer(served, body, content_type):
    http, _, _ = served
    response = await post(http, "/v1/completions", body, content_type)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", ["application/json", FASTAPI_ONLY])
async def test_an_error_the_endpoint_raises_meets_the_same_handler(served, content_type):
    http, _, exporter = served
    body = json.dumps({"model": "nope", "prompt": [1], "stream": True}).encode()
    response = await post(http, "/v1/completions", body, content_type)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    assert span.attributes["http.response.status_code"] == 404
