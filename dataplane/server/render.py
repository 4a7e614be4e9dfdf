"""Turning a request into prompt token ids, and choice events into OpenAI responses and stream chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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
    TopLogprob,
    Usage,
    new_id,
)


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)


class Renderer:
    """Accumulates the choices of one request and renders them in the request's API shape."""

    id_prefix = "cmpl"

    def __init__(self, request: Any) -> None:
        self.request = request
        self.response_id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}
        self.num_prompt_tokens = 0

    def prompt_token_ids(self, tokenizer: Any) -> list[list[int]]:
        raise NotImplementedError

    def add(self, event: ChoiceEvent) -> _Choice:
        choice = self.choices.setdefault(event.index, _Choice())
        choice.text += event.new_text
        choice.num_tokens += len(event.new_token_ids)
        choice.token_ids.extend(event.new_token_ids)
        if event.logprobs:
            choice.logprobs.extend(event.logprobs)
        if event.finish_reason:
            choice.finish_reason = event.finish_reason
        return choice

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


def chat_prompt_ids(tokenizer: Any, messages: list, *, add_generation_prompt: bool = True) -> list[int]:
    """The messages through the model's own chat template, as token ids; 400 if the template refuses."""
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        encoded = tokenizer.apply_chat_template(
            plain, add_generation_prompt=add_generation_prompt, tokenize=True
        )
    except Exception as exc:  # a template that rejects the conversation (e.g. roles out of order)
        raise BadRequest(
            f"messages: the model's chat template rejected them: {exc}", param="messages"
        ) from None
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return list(ids)


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


class CompletionRenderer(Renderer):
    id_prefix = "cmpl"
    request: CompletionRequest

    def prompt_token_ids(self, tokenizer: Any) -> list[list[int]]:
        prompt = self.request.prompt
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [tokenizer.encode(p) for p in prompt]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise BadRequest(
                "prompt: must be a string, a list of strings or token ids, and not empty", param="prompt"
            )
        vocab = len(tokenizer)
        for tokens in prompts:
            if any(not 0 <= t < vocab for t in tokens):
                raise BadRequest(f"prompt: token ids must be in [0, {vocab})", param="prompt")
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        return prompts

    def _logprobs(self, tokenizer: Any, token_ids, entries, offset: int) -> CompletionLogprobs | None:
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
        return CompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=[
                CompletionChoice(
                    index=event.index,
                    text=event.new_text,
                    logprobs=logprobs,
                    finish_reason=event.finish_reason,
                )
            ],
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

    def prompt_token_ids(self, tokenizer: Any) -> list[list[int]]:
        ids = chat_prompt_ids(tokenizer, self.request.messages)
        self.num_prompt_tokens = len(ids)
        return [ids]

    def _logprobs(self, tokenizer: Any, token_ids, entries) -> ChatLogprobs | None:
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
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=c.text),
                logprobs=self._logprobs(tokenizer, c.token_ids, c.logprobs),
                finish_reason=c.finish_reason,
            )
            for i, c in sorted(self.choices.items())
        ]
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=choices,
            usage=self.usage(),
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
        return ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=[
                ChatChunkChoice(
                    index=event.index,
                    delta=ChatDelta(content=event.new_text),
                    logprobs=logprobs,
                    finish_reason=event.finish_reason,
                )
            ],
        )

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.request.model,
            choices=[],
            usage=self.usage(),
        )
