"""A stream relay process on its own: rows from an "engine" pipe, handoffs from a "server" pipe, and the
bytes it writes to a socket pair standing in for a client's connection."""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from collections.abc import Iterator
from multiprocessing.reduction import send_handle

import pytest
from modelfleet.dataplane.engine import stream_relay
from modelfleet.dataplane.engine.stream_relay import (
    Drop,
    Forwarded,
    Handoff,
    RelayDone,
    RelayRows,
    _Relay,
    chunk_bytes,
    run_relay,
)

TEMPLATE = ('{"id":"cmpl-1","choices":[{"index":0,"text":', ',"finish_reason":', "}]}")


class Relay:
    def __init__(self, send_timeout: float = 30.0) -> None:
        context = multiprocessing.get_context("spawn")
        from_engine, self.engine = context.Pipe(duplex=False)
        self.server, relay_end = context.Pipe()
        self.process = context.Process(target=run_relay, args=(from_engine, relay_end, send_timeout))
        self.process.start()
        from_engine.close()
        relay_end.close()

    def rows(self, *rows) -> None:
        self.engine.send(RelayRows(list(rows)))

    def hand_off(self, request_id: str, sock: socket.socket, last_output_at: float = 0.0) -> None:
        self.server.send(Handoff(request_id, TEMPLATE, last_output_at))
        send_handle(self.server, sock.fileno(), self.process.pid)

    def reply(self, timeout: float = 20.0):
        assert self.server.poll(timeout), "the relay said nothing"
        return self.server.recv()

    def stop(self) -> None:
        self.engine.close()
        self.server.close()
        self.process.join(timeout=10)


@pytest.fixture
def relay() -> Iterator[Relay]:
    r = Relay()
    yield r
    r.stop()


def client_pair() -> tuple[socket.socket, socket.socket]:
    """(the server's side, the client's side) of one connection; the server's side non-blocking, as
    an event loop's sockets are."""
    server_side, client_side = socket.socketpair()
    server_side.setblocking(False)
    return server_side, client_side


def read_events(sock: socket.socket, count: int) -> list[dict]:
    """`count` chunked SSE events from the client's side."""
    sock.settimeout(20)
    data, events = b"", []
    while len(events) < count:
        size_line, sep, rest = data.partition(b"\r\n")
        if sep and len(rest) >= int(size_line, 16) + 2:
            size = int(size_line, 16)
            event, data = rest[:size], rest[size + 2 :]
            assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
            events.append(json.loads(event[6:]))
            continue
        data += sock.recv(65536)
    return events


def row(text: str, tokens: list[int], finished: bool = False, reason: str | None = None, error=None):
    return ("r1", text, tokens, reason, finished, error)


def test_a_chunk_is_an_sse_event_in_chunked_framing():
    data = chunk_bytes(TEMPLATE, 'say "hi"\n', None)
    size, _, rest = data.partition(b"\r\n")
    event = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"say \\"hi\\"\\n","finish_reason":null}]}\n\n'
    assert int(size, 16) == len(event) and rest == event + b"\r\n"
    assert json.loads(event[6:])["choices"][0]["text"] == 'say "hi"\n'


def test_rows_before_the_handoff_wait_then_everything_is_written_in_order(relay):
    server_side, client_side = client_pair()
    server_took_first = time.monotonic() - 0.5
    relay.rows(row(" a", [5]), row(" b", [6, 7]))
    time.sleep(0.2)
    assert not relay.server.poll(0.1)  # nothing written, nothing said: no socket yet
    relay.hand_off("r1", server_side, last_output_at=server_took_first)
    relay.rows(row(" c", [8], finished=True, reason="length"))
    events = read_events(client_side, 3)
    assert [e["choices"][0]["text"] for e in events] == [" a", " b", " c"]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    done = relay.reply()
    assert isinstance(done, RelayDone) and (done.request_id, done.finish_reason) == ("r1", "length")
    assert [count for count, _ in done.counts] == [1, 2, 1] and not done.client_gone
    # Gaps per token, timed at arrival: the first from the server's output (half a second before).
    assert (
        done.counts[0][1] >= 0.5
        and done.counts[1][1] < 0.2
        and all(gap is not None and gap >= 0 for _, gap in done.counts)
    )
    # The relay closed its copy of the descriptor only: the connection is still the server's.
    server_side.send(b"0\r\n\r\n")
    assert client_side.recv(16) == b"0\r\n\r\n"


def test_an_error_row_is_reported_not_written(relay):
    server_side, client_side = client_pair()
    relay.hand_off("r1", server_side)
    relay.rows(row(" a", [5]), row("", [], finished=True, reason="error", error="boom"))
    assert read_events(client_side, 1)[0]["choices"][0]["text"] == " a"
    done = relay.reply()
    assert (done.finish_reason, done.error) == ("error", "boom")
    client_side.settimeout(0.3)
    with pytest.raises(TimeoutError):
        client_side.recv(1)  # nothing after the one chunk: the server writes the error event


def test_a_stream_taken_back_is_forwarded(relay):
    relay.rows(row(" a", [5]))
    relay.server.send(Handoff("r1", None))
    relay.rows(row(" b", [6], finished=True, reason="stop"))
    forwarded = []
    while len(forwarded) < 2:
        message = relay.reply()
        assert isinstance(message, Forwarded)
        forwarded += message.rows
    assert [(r[1], r[2], r[4]) for r in forwarded] == [(" a", [5], False), (" b", [6], True)]


def test_a_dropped_stream_writes_nothing_more(relay):
    server_side, client_side = client_pair()
    relay.hand_off("r1", server_side)
    relay.rows(row(" a", [5]))
    assert len(read_events(client_side, 1)) == 1
    relay.server.send(Drop("r1"))
    time.sleep(0.3)  # rows and drops come on two pipes: rows the engine sent before the drop may be written
    relay.rows(row(" b", [6]), row("", [], finished=True, reason="abort"))
    client_side.settimeout(0.5)
    with pytest.raises(TimeoutError):
        client_side.recv(1)
    assert not relay.server.poll(0.2)


def test_a_client_gone_is_reported(relay):
    server_side, client_side = client_pair()
    relay.hand_off("r1", server_side)
    relay.rows(row(" a", [5]))
    read_events(client_side, 1)
    client_side.close()
    relay.rows(row(" b", [6]))
    relay.rows(row(" c", [7]))
    done = relay.reply()
    assert isinstance(done, RelayDone) and done.client_gone


def test_a_client_that_stops_reading_loses_its_stream_after_the_send_deadline():
    relay = Relay(send_timeout=0.5)
    try:
        server_side, client_side = client_pair()
        server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client_side.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        relay.hand_off("r1", server_side)
        text = "x" * 2000
        relay.rows(*[row(text, [i]) for i in range(200)])  # far more than the buffers hold
        started = time.monotonic()
        done = relay.reply(timeout=10)
        assert isinstance(done, RelayDone) and done.client_gone
        assert 0.4 <= time.monotonic() - started < 5
    finally:
        relay.stop()


def test_a_relay_that_exits_mid_chunk_ends_that_connection():
    """The engine process died while a client was not reading: what the relay had not written cannot be
    followed by the server's error event, so the connection ends."""
    relay = Relay()
    server_side, client_side = client_pair()
    server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_side.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    relay.hand_off("r1", server_side)
    relay.rows(*[row("x" * 2000, [i]) for i in range(50)])  # more than the buffers hold
    time.sleep(0.3)
    relay.engine.close()
    relay.process.join(timeout=10)
    assert relay.process.exitcode == 0
    client_side.settimeout(10)
    received = b""
    while chunk := client_side.recv(65536):
        received += chunk
    assert 0 < len(received) < 50 * 2000  # part of it, then the end of the connection
    relay.server.close()


def test_the_relay_exits_when_the_engine_is_gone():
    relay = Relay()
    relay.engine.close()
    relay.process.join(timeout=10)
    assert relay.process.exitcode == 0
    relay.server.close()


def test_a_stream_dropped_before_its_rows_is_forgotten_whether_they_come_or_not(monkeypatch):
    """The server drops a stream it gave up on before the handoff: the engine may have sent it rows
    (they come later, on the other pipe) or none (refused, or over at its first output)."""
    engine_end, to_relay = multiprocessing.Pipe(duplex=False)
    server_end, relay_end = multiprocessing.Pipe()
    relay = _Relay(engine_end, relay_end, send_timeout=30.0)

    def from_server(message) -> None:
        server_end.send(message)
        relay._from_server(relay_end.fileno())

    def from_engine(*rows) -> None:
        to_relay.send(RelayRows(list(rows)))
        relay._from_engine(engine_end.fileno())

    from_server(Drop("late"))
    from_engine(("late", " a", [5], None, False, None))
    from_engine(("late", "", [], "abort", True, None))
    assert relay.streams == {} and relay.unseen_drops == {} and not server_end.poll(0)
    from_server(Drop("never"))  # no row will come: remembered a while, then forgotten
    assert relay.streams == {} and list(relay.unseen_drops) == ["never"]
    monkeypatch.setattr(stream_relay, "DROP_MEMORY", -1.0)
    relay._expire_unseen_drops()
    assert relay.unseen_drops == {}


class Recorded:
    """A pipe end that keeps what is sent through it (None: sent nowhere)."""

    def __init__(self, conn=None) -> None:
        self.conn, self.sent = conn, []

    def send(self, message) -> None:
        self.sent.append(message)
        if self.conn is not None:
            self.conn.send(message)


def cpu_engine(model_dir):
    from modelfleet.dataplane.config import EngineConfig
    from modelfleet.dataplane.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(
        model_dir, device="cpu", dtype="float32", max_model_len=128, kv_cache_bytes=1 << 22
    )
    return LLMEngine(config)


def test_an_engine_hands_a_streams_text_to_its_relay_which_writes_the_same_text(tiny_model_dir, relay):
    """The engine and a relay together, as an engine process routes them: after the first output (the
    server's), the engine sends tokens alone, and the relay decodes and writes the text the engine
    would have sent."""
    from modelfleet.dataplane.engine.engine_process import OutputRoutes
    from modelfleet.dataplane.engine.messages import Outputs
    from modelfleet.dataplane.sampling_params import SamplingParams

    engine = cpu_engine(tiny_model_dir)
    server, to_relay = Recorded(), Recorded(relay.engine)
    routes = OutputRoutes(server, [to_relay])
    routes.share_tokenizer(engine.stream_tokenizer(), engine.release_text)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, output_kind="delta")
    engine.add_request("r1", engine.tokenizer.encode("Once upon a time"), params)
    routes.add("r1", 1)
    server_side, client_side = client_pair()
    while engine.has_unfinished_requests():
        routes.send(engine.step(), engine.stats())
    firsts = [o for message in server.sent if isinstance(message, Outputs) for o in message.outputs]
    assert len(firsts) == 1 and firsts[0].new_token_ids and not firsts[0].finished
    relay.hand_off("r1", server_side)
    rows = [row for message in to_relay.sent[1:] for row in message.rows]
    assert all(text is None for _, text, *_ in rows)  # no text decoded in the engine after its first output
    assert list(to_relay.sent[1].handovers) == ["r1"] and not any(m.handovers for m in to_relay.sent[2:])
    events = read_events(client_side, len(rows))
    done = relay.reply()
    assert isinstance(done, RelayDone) and done.finish_reason == "length"
    tokens = firsts[0].new_token_ids + [t for r in rows for t in r[2]]
    assert len(tokens) == 40
    text = firsts[0].new_text + "".join(e["choices"][0]["text"] for e in events)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_text_that_must_stay_in_the_engine_is_not_released(tiny_model_dir):
    """Stop strings need the text each step, and a cumulative output carries all of it: both stay. A
    released request's outputs, its abort's too, carry its tokens and no text."""
    from modelfleet.dataplane.sampling_params import SamplingParams

    engine = cpu_engine(tiny_model_dir)
    delta = dict(max_tokens=30, temperature=0.0, ignore_eos=True, output_kind="delta")
    engine.add_request("stop", [5, 6, 7], SamplingParams(stop=["zz"], **delta))
    engine.add_request("cumulative", [5, 6, 7], SamplingParams(**{**delta, "output_kind": "cumulative"}))
    engine.add_request("released", [5, 6, 7], SamplingParams(**delta))
    while not engine._requests["released"].seq.output_token_ids:
        engine.step()
    assert engine.release_text("stop") is None and engine.release_text("cumulative") is None
    assert engine.release_text("unknown") is None
    assert engine.release_text("released") is not None
    assert engine.release_text("released") is None  # once
    outputs = [o for _ in range(3) for o in engine.step() if o.request_id == "released"]
    aborted = engine.abort("released")
    assert aborted is not None and aborted.finished and aborted.finish_reason == "abort"
    assert all(o.new_token_ids and o.new_text == "" for o in outputs) and aborted.new_text == ""


def test_a_tokenizer_without_json_keeps_the_text_in_the_engine(tiny_model_dir, monkeypatch):
    from modelfleet.dataplane.engine import llm_engine

    class PythonComponents:
        def to_str(self) -> str:
            raise Exception("Custom PreTokenizer cannot be serialized")

    engine = cpu_engine(tiny_model_dir)
    assert engine.stream_tokenizer() is not None
    monkeypatch.setattr(llm_engine, "stream_backend", lambda tokenizer: PythonComponents())
    assert engine.stream_tokenizer() is None


def test_a_stream_taken_back_gets_the_text_its_relay_decoded(tiny_model_dir, relay):
    """Rows without text forwarded to the server (the socket was busy at the handoff) carry the text
    the relay decoded, from the handover on."""
    from modelfleet.dataplane.engine.detokenizer import Handover
    from modelfleet.dataplane.engine.stream_relay import RelayTokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode("Once upon a time, naïve 😀 words", add_special_tokens=False)
    relay.engine.send(RelayTokenizer(tokenizer.backend_tokenizer.to_str()))
    first, rest = ids[:3], ids[3:]
    handover = Handover(first, [])
    relay.engine.send(RelayRows([("r1", None, [rest[0]], None, False, None)], {"r1": handover}))
    relay.rows(*[("r1", None, [t], None, False, None) for t in rest[1:-1]])
    relay.rows(("r1", None, [rest[-1]], "length", True, None))
    relay.server.send(Handoff("r1", None))
    forwarded = []
    while not forwarded or not forwarded[-1][4]:
        message = relay.reply()
        assert isinstance(message, Forwarded)
        forwarded += message.rows
    assert [t for r in forwarded for t in r[2]] == rest
    text = tokenizer.decode(first) + "".join(r[1] for r in forwarded)
    assert text == tokenizer.decode(ids)
