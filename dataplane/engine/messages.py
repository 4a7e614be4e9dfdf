"""The messages between an engine's callers and the thread or process that steps it.

Commands go to the engine (AsyncLLM's thread through a deque, an engine process through its pipe);
replies come back from an engine process. Each is a small frozen dataclass, so the receiver dispatches
on its type and a misspelt field fails where the message is built, not in another process.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelfleet.dataplane.engine.llm_engine import Prompt
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.engine.protocol import EngineLimits
from modelfleet.dataplane.sampling_params import SamplingParams

# -- commands: caller -> engine ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Add:
    request_id: str
    prompt: Prompt
    priority: int
    validated: tuple[list[int], SamplingParams]  # the caller's checks passed: token ids and parameters


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Close:
    """Stop stepping and exit (an engine process)."""


Command = Add | Abort | Close

# -- replies: engine process -> caller ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    limits: EngineLimits
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The engine could not be built; the process exits."""

    message: str


@dataclass(frozen=True, slots=True)
class Outputs:
    outputs: list[RequestOutput]
    stats: EngineStats  # as of this step


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused one request when it was added."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class StepFailed:
    """A step raised: every request in flight has been aborted."""

    message: str


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine can step no more (a tensor-parallel rank died); the process exits right after."""

    message: str


Reply = Ready | StartFailed | Outputs | Refused | StepFailed | Fatal
