"""Turning a request into prompt token ids, and choice events into OpenAI responses and stream chunks."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Any

from modelfleet.dataplane.server.engine_io import ChoiceEvent
from modelfleet.dataplane.server.errors import BadRequest
from modelfleet.dataplane.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FunctionCall,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    new_id,
)
from modelfleet.dataplane.server.tools import ToolCall, ToolStream, parse_forced, parse_tool_calls
from pydantic import BaseModel


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)


class ChunkTemplate:
    """A stream chunk's JSON with its text and finish reason left open, so that a token's chunk is a
    few string joins instead of a pydantic model built and dumped. The fixed parts are pydantic's own
    dump of the chunk (with markers where the two go); the text is escaped by the json module's C
    escaper, which writes what pydantic writes for every character (a test holds them equal)."""

    __slots__ = ("head", "middle", "tail")

    def __init__(self, head: str, middle: str, tail: str) -> None:
        self.head, self.middle, self.tail = head, middle, tail

    @classmethod
    def of(cls, build: Any) -> ChunkTemplate | None:
        """The template of the chunks `build(text, finish_reason)` gives; None where it gives None."""
        # Markers no chunk's fixed parts contain, as JSON strings (random bytes: a uuid4 costs more)
        text, reason = f'"text-{os.urandom(16).hex()}"', f'"reason-{os.urandom(16).hex()}"'
        chunk: BaseModel | None = build(text[1:-1], reason[1:-1])
        if chunk is None:
            return None
        dump = chunk.model_dump_json()
        head, _, rest = dump.partition(text)
        middle, _, tail = rest.partition(reason)
        if dump.count(text) != 1 or rest.count(reason) != 1:
            raise AssertionError(f"the chunk's JSON has its text and finish reason once each: {dump}")
        return cls(head, middle, tail)

    def fill(self, text: str, finish_reason: str | None) -> str:
        reason = "null" if finish_reason is None else encode_basestring(finish_reason)
        return f"{self.head}{encode_basestring(text)}{self.middle}{reason}{self.tail}"


class Renderer:
    """Accumulates the choices of one request and renders them in the request's API shape."""

    id_prefix = "cmpl"

    def __init__(self, request: Any) -> None:
        self.request = request
        self.response_id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}
        self.num_prompt_tokens = 0
        self._templates: dict[int, ChunkTemplate | None] = {}  # per choice index, built at its first chunk

    def chunk(self, event: ChoiceEvent, tokenizer: Any) -> BaseModel:
        raise NotImplementedError

    def _plain_chunk(self, index: int, text: str, finish_reason: str | None) -> BaseModel | None:
        """The chunk of `text` alone (no logprobs, no tool calls), or None where this request's chunks
        carry more than that."""
        raise NotImplementedError

    def stream_json(self, event: ChoiceEvent, tokenizer: Any) -> str:
        """Adds a streamed event and gives its chunk as JSON: the same text as `add(event)` then
        `chunk(event, tokenizer).model_dump_json()`. Where this request's chunks carry only text, they
        come from a template and the choice keeps only its token count and finish reason (a streamed
        answer is sent as it comes, never rendered whole)."""
        template = self.plain_template(event.index)
        if template is None:
            self.add(event)
            return self.chunk(event, tokenizer).model_dump_json()
        self._count(event)
        return template.fill(event.new_text, event.finish_reason)

    def plain_template(self, index: int) -> ChunkTemplate | None:
        """The template of choice `index`'s chunks, or None where they carry more than text."""
        templates = self._templates
        if index not in templates:
            templates[index] = ChunkTemplate.of(lambda text, reason: self._plain_chunk(index, text, reason))
        return templates[index]

    def count_written(self, index: int, num_tokens: int, finish_reason: str | None) -> _Choice:
        """Counts tokens and the finish reason on choice `index`: an event's, or those a stream relay
        wrote without their passing here."""
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice()
        choice.num_tokens += num_tokens
        if finish_reason:
            choice.finish_reason = finish_reason
        return choice

    def prompt_token_ids(self, tokenizer: Any) -> list[list[int]]:
        raise NotImplementedError

    def add(self, event: ChoiceEvent) -> _Choice:
        choice = self._count(event)
        choice.text += event.new_text
        choice.token_ids.extend(event.new_token_ids)
        if event.logprobs:
            choice.logprobs.extend(event.logprobs)
        return choice

    def _count(self, event: ChoiceEvent) -> _Choice:
        """The event's tokens and finish reason, on its choice: all that a templated stream keeps."""
        return self.count_written(event.index, len(event.new_token_ids), event.finish_reason)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    def finish_reasons(self) -> list[str]:
        return [c.finish_reason for _, c in sorted(self.choices.items()) if c.finish_reason]

    def usage(self) -> Usage:
        prompt = self.num_prompt_tokens * self.request.n
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
        )


def chat_prompt_ids(
    tokenizer: Any, messages: list, *, add_generation_prompt: bool = True, tools: list | None = None
) -> list[int]:
    """The messages (and the tools offered) through the model's own chat template, as token ids; 400 if
    the template refuses."""
    plain = [_template_message(m) for m in messages]
    extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
    try:
        encoded = tokenizer.apply_chat_template(
            plain, add_generation_prompt=add_generation_prompt, tokenize=True, **extra
        )
    except Exception as exc:  # a template that rejects the conversation (e.g. roles out of order)
        raise BadRequest(
            f"messages: the model's chat template rejected them: {exc}", param="messages"
        ) from None
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return list(ids)


def _template_message(message: Any) -> dict[str, Any]:
    """A message as chat templates read it: earlier tool calls (arguments as objects, which templates
    print with `tojson`) and tool results keep their fields."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    extra = message.model_extra or {}
    for key in ("name", "tool_call_id"):
        if isinstance(extra.get(key), str):
            out[key] = extra[key]
    calls = extra.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_template_call(c) for c in calls]
    return out


def _template_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise BadRequest("messages: each of tool_calls needs a `function`", param="messages")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # not JSON: the template gets the text as it was sent
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


class CompletionRenderer(Renderer):
    id_prefix = "cmpl"
    request: CompletionRequest

    def prompt_token_ids(self, tokenizer: Any) -> list[list[int]]:
        prompt = self.request.prompt
        # The model validated `prompt` as one of its union's types, each a list of one kind: the first
        # item tells which (per-item checks here cost the event loop ~20 us for 128 token ids).
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt)]
        elif prompt and isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif prompt and isinstance(prompt[0], str):
            prompts = [tokenizer.encode(p) for p in prompt]
        elif prompt:
            prompts = [list(p) for p in prompt if isinstance(p, list)]
        else:
            raise BadRequest(
                "prompt: must be a string, a list of strings or token ids, and not empty", param="prompt"
            )
        vocab = len(tokenizer)
        for tokens in prompts:
            if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
                raise BadRequest(f"prompt: token ids must be in [0, {vocab})", param="prompt")
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        return prompts

    def _logprobs(
        self, tokenizer: Any, token_ids: Sequence[int], entries: Sequence[dict[int, float]], offset: int
    ) -> CompletionLogprobs | None:
        if self.request.logprobs is None:
            return None
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = _token_text(tokenizer, token_id)
            out.tokens.append(text)
            out.token_logprobs.append(entry.get(token_id))
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.request.logprobs]
            out.top_logprobs.append({_token_text(tokenizer, t): lp for t, lp in top})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def response(self, tokenizer: Any) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=self._logprobs(tokenizer, c.token_ids, c.logprobs, 0),
                finish_reason=c.finish_reason,
            )
            for i, c in sorted(self.choices.items())
        ]
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=choices,
            usage=self.usage(),
        )

    def opening_chunks(self) -> list[CompletionChunk]:
        return []

    def chunk(self, event: ChoiceEvent, tokenizer: Any) -> CompletionChunk:
        choice = self.choices[event.index]
        offset = len(choice.text) - len(event.new_text)
        logprobs = self._logprobs(tokenizer, event.new_token_ids, event.logprobs or (), offset)
        return self._text_chunk(event.index, event.new_text, event.finish_reason, logprobs)

    def _plain_chunk(self, index: int, text: str, finish_reason: str | None) -> CompletionChunk | None:
        if self.request.logprobs is not None:
            return None
        return self._text_chunk(index, text, finish_reason)

    def _text_chunk(
        self, index: int, text: str, finish_reason: str | None, logprobs: CompletionLogprobs | None = None
    ) -> CompletionChunk:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return CompletionChunk(
            id=self.response_id, created=self.created, model=self.request.model, choices=[choice]
        )

    def usage_chunk(self) -> CompletionChunk:
        return CompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=[],
            usage=self.usage(),
        )


class ChatRenderer(Renderer):
    id_prefix = "chatcmpl"
    request: ChatCompletionRequest

    def __init__(self, request: Any) -> None:
        super().__init__(request)
        self.tool_names = request.offered_tools()
        self.forced_tool = request.forced_tool()
        self.tool_streams: dict[int, ToolStream] = {}

    def prompt_token_ids(self, tokenizer: Any) -> list[list[int]]:
        tools = self.request.tools if self.tool_names else None
        ids = chat_prompt_ids(tokenizer, self.request.messages, tools=tools)
        self.num_prompt_tokens = len(ids)
        return [ids]

    def _logprobs(
        self, tokenizer: Any, token_ids: Sequence[int], entries: Sequence[dict[int, float]]
    ) -> ChatLogprobs | None:
        if not self.request.logprobs:
            return None
        top_n = self.request.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = _token_text(tokenizer, token_id)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=entry.get(token_id, float("-inf")),
                    bytes=list(text.encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=(t := _token_text(tokenizer, tid)), logprob=lp, bytes=list(t.encode())
                        )
                        for tid, lp in top
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def response(self, tokenizer: Any) -> ChatCompletionResponse:
        choices = [self._choice(i, c, tokenizer) for i, c in sorted(self.choices.items())]
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=choices,
            usage=self.usage(),
        )

    def _choice(self, index: int, choice: _Choice, tokenizer: Any) -> ChatChoice:
        content: str | None = choice.text
        calls: list[ToolCall] = []
        if self.forced_tool is not None:
            calls = parse_forced(choice.text, self.forced_tool, self.tool_names)
            content = None if calls else choice.text
        elif self.tool_names:
            content, calls = parse_tool_calls(choice.text, self.tool_names)
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=content, tool_calls=_calls_out(calls) or None),
            logprobs=self._logprobs(tokenizer, choice.token_ids, choice.logprobs),
            finish_reason=_finish_reason(choice.finish_reason, calls),
        )

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        """The first chunk of each choice carries the role, as OpenAI's stream does."""
        return [
            ChatCompletionChunk(
                id=self.response_id,
                created=self.created,
                model=self.request.model,
                choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))],
            )
            for i in range(self.request.n)
        ]

    def chunk(self, event: ChoiceEvent, tokenizer: Any) -> ChatCompletionChunk:
        logprobs = self._logprobs(tokenizer, event.new_token_ids, event.logprobs or ())
        delta, finish_reason = ChatDelta(content=event.new_text), event.finish_reason
        if self.tool_names:
            # Text that may start a tool call is held back until the choice ends and shows what it is.
            stream = self.tool_streams.setdefault(event.index, ToolStream(self.tool_names, self.forced_tool))
            delta.content = stream.feed(event.new_text)
            if event.finish_reason:
                rest, calls = stream.finish()
                delta.content += rest
                finish_reason = _finish_reason(event.finish_reason, calls)
                if calls:
                    delta.tool_calls = [
                        ToolCallDelta(index=i, id=c.id, type="function", function=c.function)
                        for i, c in enumerate(_calls_out(calls))
                    ]
        return self._delta_chunk(event.index, delta, finish_reason, logprobs)

    def _plain_chunk(self, index: int, text: str, finish_reason: str | None) -> ChatCompletionChunk | None:
        if self.request.logprobs or self.tool_names:
            return None
        return self._delta_chunk(index, ChatDelta(content=text), finish_reason)

    def _delta_chunk(
        self, index: int, delta: ChatDelta, finish_reason: str | None, logprobs: ChatLogprobs | None = None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.request.model, choices=[choice]
        )

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=[],
            usage=self.usage(),
        )


def _calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    # An answer that ends in calls finished to call them ("stop" from the engine: the model was done).
    return "tool_calls" if calls and reason == "stop" else reason
