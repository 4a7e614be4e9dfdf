"""What the server asks of an engine, whichever runs it: a thread of the server (AsyncLLM and its ONNX and
TensorRT subclasses) or a process of its own (AsyncLLMProcess). The server types every engine it holds
as `Engine`, so a new kind of engine is checked against this, not found out by a failing request."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from modelfleet.dataplane.engine.llm_engine import Prompt
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.sampling_params import SamplingParams

FailureHook = Callable[[str], None]


@dataclass(frozen=True)
class EngineLimits:
    """What the engine runs with, once built: the server sizes admission and checks prompts by these."""

    max_num_seqs: int  # sequences stepped at once
    max_model_len: int  # prompt plus output, in tokens (lowered to what the KV cache holds)
    vocab_size: int


class Engine(Protocol):
    # Why the engine can serve no more (its process or a tensor-parallel rank died), or None.
    failure: str | None
    # Set by the engine's owner; called once with `failure`, from one of the engine's threads.
    on_failure: FailureHook | None

    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer, or None (token ids only)

    @property
    def limits(self) -> EngineLimits: ...

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        sink: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, the last one finished; closing the iterator aborts the request. An
        engine with stream relays may hand the outputs after the first to a relay writing to `sink`
        (stream_relay.StreamSink); others ignore it."""
        ...

    def abort(self, request_id: str) -> Awaitable[None]: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
