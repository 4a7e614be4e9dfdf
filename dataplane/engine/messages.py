"""The messages between an engine's callers and the thread or process that steps it.

Commands go to the engine (AsyncLLM's thread through a deque, an engine process through its pipe);
replies come back from an engine process. Each is a small frozen dataclass, so the receiver dispatches
on its type and a misspelt field fails where the message is built, not in another process.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any

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
    sink: int = 0  # who reads the outputs after the first: 0 the caller, k its k-th stream relay


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
    text_in_relays: bool = False  # whether its stream relays decode relayed requests' text


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The engine could not be built; the process exits."""

    message: str


@dataclass(frozen=True, slots=True)
class Outputs:
    outputs: list[RequestOutput]
    stats: EngineStats  # as of this step

    def __reduce__(self) -> tuple[Any, ...]:
        # Each output travels as a tuple of its fields and is rebuilt with one call to its class: a
        # pickled dataclass is rebuilt attribute by attribute, which the server's reader thread pays for
        # every output of every step.
        return _outputs, ([_output_row(output) for output in self.outputs], self.stats)


_output_row = operator.attrgetter(*(f.name for f in fields(RequestOutput)))


def _outputs(rows: list[tuple[Any, ...]], stats: EngineStats) -> Outputs:
    return Outputs([RequestOutput(*row) for row in rows], stats)


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused one request when it was added."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class StepFailed:
    """A step raised: every request in flight has been aborted. The `relayed` ones end at their stream
    relays (an error the relay reports once what it holds is written); the server fails the others."""

    message: str
    relayed: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine can step no more (a tensor-parallel rank died); the process exits right after."""

    message: str


Reply = Ready | StartFailed | Outputs | Refused | StepFailed | Fatal
