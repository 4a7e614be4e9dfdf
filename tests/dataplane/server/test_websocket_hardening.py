"""The WebSocket answers bad frames with an error message and keeps serving on the same socket; an
`api_key` in its query string never reaches the server's log."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BAD_FRAMES = [
    (b"\x00\x01binary", "binary frames"),
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ('{"model": "tiny", "prompt": "bad \\ud800", "max_tokens": 1}', "lone surrogate"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}', "text"),
]


@pytest.fixture
def server_log():
    """What uvicorn logs at INFO through its error logger (where it names each WebSocket's path)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("uvicorn.error")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_bad_frames_get_an_error_and_the_socket_keeps_serving(fleet):
    from websockets.sync.client import connect

    url = fleet.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url, max_size=None) as socket:
        for frame, expected in BAD_FRAMES:
            socket.send(frame)
            message = json.loads(socket.recv(timeout=30))
            assert message["type"] == "error", message
            assert expected in message["error"]["message"]
        socket.send(json.dumps({"model": "tiny", "prompt": "still here", "max_tokens": 1}))
        assert json.loads(socket.recv(timeout=30))["type"] == "start"


def test_an_api_key_in_the_query_string_is_not_logged(fleet, server_log):
    from websockets.sync.client import connect

    url = fleet.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url + "?api_key=sk-free") as socket:
        socket.send(json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}))
        assert json.loads(socket.recv(timeout=30))["type"] == "start"
    accepted = [line for line in server_log if "WebSocket" in line]
    assert accepted, server_log
    assert all("sk-free" not in line for line in server_log)
    assert "api_key=[redacted]" in accepted[0]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
# Bodies shaped like requests, so that generation reaches past the first checks.
REQUESTS = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "tiny@v1", "nope", ""]), "max_tokens": st.integers(-2, 3)},
    optional={"prompt": JSON, "messages": JSON, "stop": JSON, "seed": st.integers(), "top_k": st.integers()},
)


def test_fuzzed_frames_get_an_answer_and_never_close_the_socket(fleet):
    from websockets.sync.client import connect

    url = fleet.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url, max_size=None) as socket:

        @settings(max_examples=150, deadline=None, derandomize=True, database=None)
        @given(frame=st.one_of(REQUESTS.map(json.dumps), JSON.map(json.dumps), st.text(max_size=30)))
        def one(frame: str) -> None:
            socket.send(frame)
            message = json.loads(socket.recv(timeout=30))
            while message["type"] == "chunk" or message["type"] == "start":
                message = json.loads(socket.recv(timeout=30))
            assert message["type"] in ("done", "error"), message
            if message["type"] == "error":
                assert message["error"]["code"] != "internal_error", (frame, message)

        one()
        socket.send(json.dumps({"model": "tiny", "prompt": "still here", "max_tokens": 1}))
        assert json.loads(socket.recv(timeout=30))["type"] == "start"
