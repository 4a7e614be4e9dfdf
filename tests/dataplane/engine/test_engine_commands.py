"""The engine process's child applies typed commands (engine/messages.py), dispatching on their type."""

from __future__ import annotations

from modelfleet.dataplane.engine.engine_process import OutputRoutes, _apply
from modelfleet.dataplane.engine.messages import Abort, Add, Close, Outputs, Refused
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.engine.stream_relay import RelayRows
from modelfleet.dataplane.sampling_params import SamplingParams


class RecordingEngine:
    """The child's side of an engine process: what `_apply` asks of the engine."""

    def __init__(self) -> None:
        self.added: list[tuple[str, list[int], int]] = []

    def add_request(self, request_id, prompt, *, priority, validated) -> None:
        if request_id == "bad":
            raise ValueError("prompt: too long")
        self.added.append((request_id, prompt, priority))

    def abort(self, request_id: str) -> RequestOutput | None:
        return RequestOutput(request_id, [], finish_reason="abort", finished=True)

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0.0, 1, 1)


class Pipe:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


def test_the_engine_process_dispatches_each_command_on_its_type():
    engine, pipe = RecordingEngine(), Pipe()
    routes = OutputRoutes(pipe, [])
    params = SamplingParams(max_tokens=2)
    assert _apply(Add("a", [1, 2], 3, ([1, 2], params)), routes, engine)
    assert _apply(Add("bad", [1], 0, ([1], params)), routes, engine)
    assert _apply(Abort("a"), routes, engine)
    assert engine.added == [("a", [1, 2], 3)]
    refused, aborted = pipe.sent
    assert refused == Refused("bad", "prompt: too long")
    assert isinstance(aborted, Outputs) and aborted.outputs[0].finish_reason == "abort"
    assert not _apply(Close(), routes, engine)  # the loop ends


def output(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id, [], text, [7], text, [7], finish_reason="stop" if finished else None, finished=finished
    )


class DeadPipe:
    def send(self, message: object) -> None:
        raise BrokenPipeError


def test_a_relayed_request_sends_its_first_output_to_the_server_and_the_rest_to_its_relay():
    server, relay = Pipe(), Pipe()
    routes = OutputRoutes(server, [relay])
    routes.add("r", 1)
    routes.add("s", 0)  # the server's own
    for step in (
        [output("r", " a"), output("s", " x")],
        [output("r", " b"), output("s", " y", finished=True)],
        [output("r", " c", finished=True)],
    ):
        routes.send(step, RecordingEngine().stats())
    assert [[o.new_text for o in m.outputs] for m in server.sent] == [[" a", " x"], [" y"], []]
    assert all(isinstance(m, Outputs) for m in server.sent)  # with the stats every step
    rows = [row for message in relay.sent for row in message.rows]
    assert all(isinstance(m, RelayRows) for m in relay.sent)
    assert rows == [("r", " b", [7], None, False, None), ("r", " c", [7], "stop", True, None)]
    routes.send([output("r", " d")], RecordingEngine().stats())  # over: a new id's output is the server's
    assert server.sent[-1].outputs[0].new_text == " d"


def test_a_request_that_ends_at_its_first_output_never_reaches_its_relay():
    server, relay = Pipe(), Pipe()
    routes = OutputRoutes(server, [relay])
    routes.add("r", 1)
    routes.send([output("r", " a", finished=True)], RecordingEngine().stats())
    routes.send([output("r", " again")], RecordingEngine().stats())
    assert relay.sent == [] and len(server.sent) == 2


def test_a_dead_relay_loses_its_rows_and_the_engine_goes_on():
    server = Pipe()
    routes = OutputRoutes(server, [DeadPipe()])
    routes.add("r", 1)
    for text in (" a", " b", " c"):
        routes.send([output("r", text)], RecordingEngine().stats())
    assert [m.outputs[0].new_text for m in server.sent if m.outputs] == [" a"]


def test_a_failed_step_ends_relayed_requests_at_their_relays_with_the_error():
    server, relay = Pipe(), Pipe()
    routes = OutputRoutes(server, [relay])
    for request_id, sink in (("relayed", 1), ("first", 1), ("own", 0)):
        routes.add(request_id, sink)
    routes.send([output("relayed", " a")], RecordingEngine().stats())  # its rest goes to the relay
    aborted = [output(request_id, "", finished=True) for request_id in ("relayed", "first", "own")]
    assert routes.fail(aborted, "engine step failed: boom") == {"relayed"}
    # The relay reports an error (after what it holds), not a finished answer; the server gets nothing:
    # it fails its own streams on StepFailed, and must leave the relayed one's socket to the relay.
    assert [row for message in relay.sent for row in message.rows] == [
        ("relayed", "", [7], "error", True, "engine step failed: boom")
    ]
    assert len(server.sent) == 1
    routes.send([output("first", " later")], RecordingEngine().stats())  # over: no longer awaited
    assert server.sent[-1].outputs[0].new_text == " later" and len(relay.sent) == 1


class FailingEngine(RecordingEngine):
    """One step that raises, with `failure` set where the engine can step no more (a dead rank)."""

    def __init__(self, failure: str | None) -> None:
        super().__init__()
        self.failure = failure
        self.scheduler = type("Scheduler", (), {"requests": {}})()
        self.stepped = False

    def has_unfinished_requests(self) -> bool:
        return not self.stepped

    def step(self):
        self.stepped = True
        raise RuntimeError("Connection reset by peer")


class CommandPipe(Pipe):
    """The child's end of the pipe: nothing waiting but a Close once the engine is idle."""

    def poll(self) -> bool:
        return False

    def recv(self) -> object:
        return Close()


def test_a_step_broken_by_a_dead_rank_ends_the_process_naming_the_rank(monkeypatch):
    """A collective that fails because a rank died must not reach the streams as the step's own error:
    the process exits with the rank's failure (Fatal), whichever of the two was noticed first."""
    import pytest
    from modelfleet.dataplane.engine import engine_process
    from modelfleet.dataplane.engine.messages import Fatal, StepFailed

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(engine_process.os, "_exit", exit_)
    dead = "tensor-parallel rank 1 (pid 7) exited with code -9"
    pipe = CommandPipe()
    with pytest.raises(SystemExit):
        engine_process._serve(pipe, FailingEngine(dead), OutputRoutes(pipe, []))
    assert pipe.sent == [Fatal(dead)]
    # a step that fails on its own fails its requests, and the engine goes on
    pipe = CommandPipe()
    engine_process._serve(pipe, FailingEngine(None), OutputRoutes(pipe, []))
    assert pipe.sent == [StepFailed("RuntimeError: Connection reset by peer", frozenset())]
