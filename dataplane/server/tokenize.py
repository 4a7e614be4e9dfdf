"""`/tokenize`, `/detokenize` and `/version`, in vLLM's request and response shapes: clients count tokens
or check a prompt's length with the served model's own tokenizer and chat template."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from modelfleet.dataplane.engine.protocol import Engine
from modelfleet.dataplane.server.errors import BadRequest, ModelNotFound, ModelUnavailable
from modelfleet.dataplane.server.protocol import ChatMessage, Tool
from modelfleet.dataplane.server.render import chat_prompt_ids
from modelfleet.dataplane.server.router import RouteError, route, split_model_field
from pydantic import BaseModel, ConfigDict, Field, model_validator

INLINE_CHARS = 16_384  # longer texts are tokenized on a worker thread, as for generation


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: counted as the chat template prints them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either `prompt` or `messages`, not both or neither")
        if self.tools and self.messages is None:
            raise ValueError("tools: only with `messages`")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def modelfleet_version() -> str:
    try:
        return importlib.metadata.version("modelfleet")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def tokenize(dataplane: Any, request: TokenizeRequest) -> TokenizeResponse:
    async with _LeasedEngine(dataplane, request.model) as engine:
        tokenizer = engine.tokenizer
        if request.messages is not None:
            ids = chat_prompt_ids(
                tokenizer,
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                tools=request.tools,
            )
        elif len(request.prompt or "") > INLINE_CHARS:
            ids = await asyncio.to_thread(_encode, tokenizer, request.prompt, request.add_special_tokens)
        else:
            ids = _encode(tokenizer, request.prompt, request.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=engine.limits.max_model_len, tokens=ids, token_strs=strs
        )


async def detokenize(dataplane: Any, request: DetokenizeRequest) -> DetokenizeResponse:
    async with _LeasedEngine(dataplane, request.model) as engine:
        tokenizer = engine.tokenizer
        vocab = len(tokenizer)
        if any(not 0 <= t < vocab for t in request.tokens):
            raise BadRequest(f"tokens: token ids must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))


def _encode(tokenizer: Any, text: str | None, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text or "", add_special_tokens=add_special_tokens))


class _LeasedEngine:
    """The engine of the version this model field routes to (loaded if needed), held while in use."""

    def __init__(self, dataplane: Any, model_field: str) -> None:
        name, pinned = split_model_field(model_field)
        table = dataplane.tables.get(name)
        if table is None:
            known = ", ".join(sorted(dataplane.tables)) or "none"
            raise ModelNotFound(
                f"model '{model_field}' does not exist; served models: {known}", param="model"
            )
        try:
            version = route(table, pinned=pinned, rng=dataplane.rng).version
        except RouteError as exc:
            if exc.status == 404:
                raise ModelNotFound(str(exc), param="model") from None
            raise ModelUnavailable(str(exc), code=exc.code) from None
        self._lease = dataplane.manager.lease(name, version)

    async def __aenter__(self) -> Engine:
        slot = await self._lease.__aenter__()
        assert slot.engine is not None  # a lease holds a loaded version
        return slot.engine

    async def __aexit__(self, *exc: Any) -> None:
        await self._lease.__aexit__(*exc)
