"""The edge between the server and the engine: sampling parameters in, choice events out.

OpenAI's `n` and batched prompts become several engine requests (the engine takes n=1), whose outputs
are merged into one stream of `ChoiceEvent`s; closing that stream aborts every engine request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from modelfleet.dataplane.engine.outputs import RequestOutput
from modelfleet.dataplane.engine.protocol import Engine
from modelfleet.dataplane.engine.stream_relay import RelayDone, StreamSink
from modelfleet.dataplane.sampling_params import SamplingParams
from modelfleet.dataplane.server.errors import BadRequest
from modelfleet.dataplane.server.protocol import ChatCompletionRequest


@dataclass(slots=True)  # not frozen: one is built per streamed output, and a frozen one costs 2.5x
class ChoiceEvent:
    index: int
    new_text: str = ""
    new_token_ids: Sequence[int] = ()
    logprobs: Sequence[dict[int, float]] | None = None  # one per new token
    finish_reason: str | None = None
    error: str | None = None
    relayed: RelayDone | None = None  # the last event of a stream whose rest a relay wrote


def build_sampling_params(request: Any, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """OpenAI request fields -> engine SamplingParams (defaults as OpenAI documents them)."""
    values: dict[str, Any] = {
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "stop": list(request.stop or []),
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "ignore_eos": request.ignore_eos,
        "logit_bias": dict(request.logit_bias or {}),
        # chat only: a response format, or the calls a tool_choice forces
        "structured": request.structured() if isinstance(request, ChatCompletionRequest) else None,
        # events carry only what is new; cumulative outputs would copy each request's whole text and
        # tokens (and, from an engine process, pickle them) on every step
        "output_kind": "delta",
    }
    if request.top_k is not None:
        values["top_k"] = request.top_k
    if request.min_p is not None:
        values["min_p"] = request.min_p
    if request.repetition_penalty is not None:
        values["repetition_penalty"] = request.repetition_penalty
    return SamplingParams(**values)


def _event(index: int, output: RequestOutput) -> ChoiceEvent:
    if output.relayed is not None:
        return ChoiceEvent(
            index, finish_reason=output.finish_reason, error=output.error, relayed=output.relayed
        )
    # A delta output (the server asks for them): its logprobs are the new tokens' alone. Its lists are
    # the event's own (nothing else reads the output), so they are not copied.
    return ChoiceEvent(
        index,
        output.new_text or "",
        output.new_token_ids or (),
        output.logprobs,
        output.finish_reason if output.finished else None,
        output.error,
    )


async def _one(
    engine: Engine,
    index: int,
    prompt: list[int],
    params: SamplingParams,
    request_id: str,
    sink: StreamSink | None = None,
) -> AsyncGenerator[ChoiceEvent, None]:
    try:
        if sink is None:
            stream = engine.generate(prompt, params, request_id=request_id)
        else:  # an engine with stream relays (engine_process.AsyncLLMProcess)
            stream = engine.generate(prompt, params, request_id=request_id, sink=sink)
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield _event(index, output)
    except ValueError as exc:  # the engine refused the request before any output
        raise BadRequest(str(exc)) from None


def merged_events(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    request_id: str,
    sink: StreamSink | None = None,
) -> AsyncGenerator[ChoiceEvent, None]:
    """Events of all choices (index = prompt_index * n + sample_index), in arrival order. One choice
    (the common case) is its own stream: no layer in between to pass every token through; it alone may
    be written by a stream relay to `sink`."""
    subs = []
    for p_index, prompt in enumerate(prompts):
        for s_index in range(n):
            sub_params = params
            if n > 1 and params.seed is not None:
                # Same seed for every sample would give n identical answers.
                sub_params = dataclasses.replace(params, seed=params.seed + s_index)
            subs.append((p_index * n + s_index, prompt, sub_params))
    if len(subs) == 1:
        index, prompt, sub_params = subs[0]
        return _one(engine, index, prompt, sub_params, request_id, sink)
    return _interleaved(engine, subs, request_id)


async def _interleaved(
    engine: Engine, subs: list[tuple[int, list[int], SamplingParams]], request_id: str
) -> AsyncGenerator[ChoiceEvent, None]:
    queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

    async def pump(index: int, prompt: list[int], sub_params: SamplingParams) -> None:
        try:
            async with contextlib.aclosing(
                _one(engine, index, prompt, sub_params, f"{request_id}-{index}")
            ) as s:
                async for event in s:
                    queue.put_nowait(event)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(*sub)) for sub in subs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
