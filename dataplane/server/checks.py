"""The limits a request must meet before it reaches an engine: each refusal is a 400 naming the limit."""

from __future__ import annotations

from typing import Any

from modelfleet.dataplane.sampling_params import SamplingParams
from modelfleet.dataplane.server.engine_io import build_sampling_params
from modelfleet.dataplane.server.errors import BadRequest, PromptTooLong
from modelfleet.dataplane.server.protocol import ChatCompletionRequest
from modelfleet.dataplane.server.settings import ServerSettings


def check_request(
    settings: ServerSettings, request: Any, prompts: list[list[int]], max_model_len: int | None
) -> SamplingParams:
    """Limits the server and the model impose on the prompt and parameters; 400 naming the limit."""
    prompt_limit = settings.max_prompt_tokens or (max_model_len - 1 if max_model_len else 0)
    limit_name = "max_prompt_tokens" if settings.max_prompt_tokens else "the model's max_model_len - 1"
    for tokens in prompts:
        if not tokens:
            raise BadRequest("prompt: is empty; send at least one token", param="prompt")
        if prompt_limit and len(tokens) > prompt_limit:
            raise PromptTooLong(
                f"prompt: has {len(tokens)} tokens, over the limit of {prompt_limit} ({limit_name}); "
                "shorten it",
                param="prompt",
            )
    max_tokens = requested_max_tokens(request) or settings.default_max_tokens
    if max_tokens > settings.max_tokens_limit:
        raise BadRequest(
            f"max_tokens: {max_tokens} is over the server's limit of {settings.max_tokens_limit}",
            param="max_tokens",
        )
    if max_model_len and requested_max_tokens(request):
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > max_model_len:
            raise BadRequest(
                f"max_tokens: the prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {max_model_len} tokens; lower max_tokens",
                param="max_tokens",
            )
    if request.n > settings.max_n:
        raise BadRequest(f"n: {request.n} is over the server's limit of {settings.max_n}", param="n")
    top = requested_logprobs(request)
    if top is not None and top > settings.max_logprobs:
        raise BadRequest(
            f"logprobs: {top} is over the server's limit of {settings.max_logprobs}", param="logprobs"
        )
    try:
        return build_sampling_params(request, max_tokens=max_tokens, logprobs=top)
    except ValueError as exc:
        param = str(exc).split(":", 1)[0]
        raise BadRequest(str(exc), param=param) from None


def requested_max_tokens(request: Any) -> int | None:
    return getattr(request, "max_completion_tokens", None) or request.max_tokens


def requested_logprobs(request: Any) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs
