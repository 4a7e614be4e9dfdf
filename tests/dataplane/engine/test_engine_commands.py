"""The engine process's child applies typed commands (engine/messages.py), dispatching on their type."""

from __future__ import annotations

from modelfleet.dataplane.engine.engine_process import _apply
from modelfleet.dataplane.engine.messages import Abort, Add, Close, Outputs, Refused
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
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
    params = SamplingParams(max_tokens=2)
    assert _apply(Add("a", [1, 2], 3, ([1, 2], params)), pipe, engine)
    assert _apply(Add("bad", [1], 0, ([1], params)), pipe, engine)
    assert _apply(Abort("a"), pipe, engine)
    assert engine.added == [("a", [1, 2], 3)]
    refused, aborted = pipe.sent
    assert refused == Refused("bad", "prompt: too long")
    assert isinstance(aborted, Outputs) and aborted.outputs[0].finish_reason == "abort"
    assert not _apply(Close(), pipe, engine)  # the loop ends
