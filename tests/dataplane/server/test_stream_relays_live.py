"""The server with stream relays, end to end on the CPU: an engine in its own process (the loader is made
to believe a GPU is present), two relays writing streamed answers to the clients' sockets, and the
official client reading them. What a relay writes must be what the server would have written."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from modelfleet.dataplane.engine.messages import Abort
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import LiveServer, engine_process_server, openai_client


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with engine_process_server(ServerSettings(stream_relays=2), tiny_model_dir) as live:
        yield live


BODY = dict(
    model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
)


def generated_tokens(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(r'^modelfleet_generation_tokens_total\{[^}]*version="v1"[^}]*\} (\S+)$', text, re.M)
    assert match, "no generation token counter for v1"
    return float(match.group(1))


def test_a_relayed_stream_is_what_the_server_would_write(server: LiveServer):
    engine = server.engine("tiny", "v1")
    assert engine.stream_relays == 2 and engine.text_in_relays  # the relays decode the text they write
    whole = openai_client(server).completions.create(**BODY)
    before, tokens_before = engine.streams_handed_off, generated_tokens(server)
    chunks = list(
        openai_client(server).completions.create(stream=True, stream_options={"include_usage": True}, **BODY)
    )
    assert engine.streams_handed_off == before + 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert all(c.id == chunks[0].id for c in chunks)
    assert generated_tokens(server) - tokens_before == 24  # the relay's tokens are counted once


def test_a_relayed_chat_stream_equals_the_whole_answer(server: LiveServer):
    engine = server.engine("tiny", "v1")
    body = dict(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = openai_client(server).chat.completions.create(**body)
    before = engine.streams_handed_off
    chunks = list(openai_client(server).chat.completions.create(stream=True, **body))
    assert engine.streams_handed_off == before + 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # usage only when asked


def test_streams_with_more_than_text_stay_with_the_server(server: LiveServer):
    engine = server.engine("tiny", "v1")
    before = engine.streams_handed_off
    chunks = list(openai_client(server).completions.create(stream=True, logprobs=2, **BODY))
    two = list(openai_client(server).completions.create(stream=True, n=2, **BODY))
    assert engine.streams_handed_off == before  # logprobs and n=2 chunks carry more than a template
    assert all(c.choices[0].logprobs is not None for c in chunks if c.choices and c.choices[0].text)
    assert {c.choices[0].index for c in two if c.choices} == {0, 1}


def running(server: LiveServer) -> int:
    return server.engine("tiny", "v1").stats().num_running


@pytest.fixture
def aborted(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The ids of the requests the server asks its engine to abort, while the test runs."""
    engine, ids = server.engine("tiny", "v1"), set()
    submit = engine._submit

    def recording(command: object) -> None:
        if isinstance(command, Abort):
            ids.add(command.request_id)
        submit(command)

    monkeypatch.setattr(engine, "_submit", recording)
    return ids


def test_a_client_that_leaves_mid_stream_frees_its_request(server: LiveServer, aborted: set[str]):
    body = json.dumps({**{k: v for k, v in BODY.items() if k != "extra_body"}, "ignore_eos": True,
                       "max_tokens": 400, "stream": True})  # fmt: skip
    host, port = server.url.removeprefix("http://").split(":")
    engine = server.engine("tiny", "v1")
    before = engine.streams_handed_off
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        received = b""
        while received.count(b"data: ") < 5:
            received += sock.recv(4096)
    deadline = time.monotonic() + 20
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(server) == 0 and engine.streams_handed_off == before + 1
    assert len(aborted) == 1  # stopped, not run to its end
    assert openai_client(server).completions.create(**BODY).usage.completion_tokens == 24  # still serving


def test_a_relay_that_dies_ends_its_streams_with_an_error_and_serving_goes_on(
    server: LiveServer, aborted: set[str]
):
    engine = server.engine("tiny", "v1")
    stream = openai_client(server).completions.create(stream=True, **{**BODY, "max_tokens": 400})
    iterator = iter(stream)
    next(iterator)  # the first token's chunk, written by the server; the rest is the relay's
    time.sleep(0.2)
    relayed = set()
    for link in engine._relays:
        if link.requests:
            relayed |= link.requests
            os.kill(link.process.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="relay"):
        for _ in iterator:
            pass
    # The engine stops the requests too: their streams ended in an error, which aborts nothing itself.
    assert relayed and relayed <= aborted
    answers = [openai_client(server).completions.create(stream=True, **BODY) for _ in range(3)]
    assert all("".join(c.choices[0].text for c in a if c.choices) for a in answers)


def test_an_engine_that_dies_ends_relayed_streams_with_its_reason(tiny_model_dir: Path):
    """The relay writes the rows it had, then exits; its reader, not the engine's, fails the stream (the
    socket is the relay's until then), with the engine's reason."""
    with engine_process_server(ServerSettings(stream_relays=1), tiny_model_dir) as live:
        engine = live.engine("tiny", "v1")
        iterator = iter(openai_client(live).completions.create(stream=True, **{**BODY, "max_tokens": 400}))
        next(iterator)
        time.sleep(0.2)
        assert engine.streams_handed_off == 1
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match=r"engine process exited \(code -9\)"):
            for _ in iterator:
                pass
