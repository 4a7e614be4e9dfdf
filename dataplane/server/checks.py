"""The limits a request must meet before it reaches an engine: each refusal is a 400 naming the limit."""

from __future__ import annotations

import contextlib
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
    max_tokens = requested_max_tokens(request) or default_max_tokens(
        settings, request, prompts, max_model_len
    )
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


def default_max_tokens(
    settings: ServerSettings, request: Any, prompts: list[list[int]], max_model_len: int | None
) -> int:
    """A chat answer without max_tokens may use the rest of the context (as OpenAI's and vLLM's do), up
    to the server's max_tokens_limit; a legacy completion gets default_max_tokens (OpenAI's 16)."""
    if not isinstance(request, ChatCompletionRequest) or not max_model_len:
        return settings.default_max_tokens
    room = max_model_len - max(len(p) for p in prompts)
    return max(1, min(room, settings.max_tokens_limit))


def fit_default_max_tokens(
    request: Any, params: SamplingParams, prompts: list[list[int]], tokens_per_minute: int
) -> None:
    """A default max_tokens (none was asked for) shrinks to what the key's token rate can ever allow, so
    that the request runs rather than being refused for a length the client never asked for."""
    if requested_max_tokens(request) or not tokens_per_minute:
        return
    sequences = len(prompts) * request.n
    room = (tokens_per_minute - sum(len(p) for p in prompts) * request.n) // sequences
    params.max_tokens = max(1, min(params.max_tokens, room))


def requested_max_tokens(request: Any) -> int | None:
    # isinstance, not getattr: a field a pydantic model lacks is an AttributeError built (~1.5 us), and
    # this runs several times per request
    if isinstance(request, ChatCompletionRequest):
        return request.max_completion_tokens or request.max_tokens
    return request.max_tokens


def requested_logprobs(request: Any) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


# A token's text is at most the vocabulary's longest entry; normalizers (NFKC, composition) can merge a
# few characters into one, hence the factor. Over this bound a prompt cannot fit, whatever its tokens.
_NORMALIZER_ROOM = 4


def check_batch(settings: ServerSettings, request: Any) -> int:
    """How many prompts a completion request carries (1 for chat); 400 past max_batch_prompts. Runs before
    anything is tokenized."""
    prompt = None if isinstance(request, ChatCompletionRequest) else request.prompt
    count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    if count > settings.max_batch_prompts:
        raise BadRequest(
            f"prompt: {count} prompts in one request, over the server's limit of "
            f"{settings.max_batch_prompts} (max_batch_prompts); send them in several requests",
            param="prompt",
        )
    return count


def prompt_texts(request: Any) -> list[str]:
    """The texts the tokenizer will read: each text prompt, or a chat's messages as one."""
    if isinstance(request, ChatCompletionRequest):
        return ["".join(m.text() for m in request.messages)]
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    return [p for p in prompt if isinstance(p, str)] if isinstance(prompt, list) else []


def check_prompt_chars(
    settings: ServerSettings, request: Any, tokenizer: Any, max_model_len: int | None
) -> int:
    """400 for a text too long to fit the token limit, before tokenizing it; the total characters."""
    texts = prompt_texts(request)
    total = sum(len(t) for t in texts)
    token_limit = settings.max_prompt_tokens or (max_model_len - 1 if max_model_len else 0)
    longest = longest_token_chars(tokenizer)
    if not token_limit or not longest:
        return total
    bound = token_limit * longest * _NORMALIZER_ROOM
    for text in texts:
        if len(text) > bound:
            raise PromptTooLong(
                f"prompt: {len(text)} characters cannot fit in {token_limit} tokens (a token of this model "
                f"is at most {longest} characters); shorten it",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            )
    return total


def longest_token_chars(tokenizer: Any) -> int | None:
    """The vocabulary's longest token in characters (computed once per tokenizer), None if unknown."""
    cached = getattr(tokenizer, "_modelfleet_longest_token", None)
    if cached is not None:
        return cached
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None
    with contextlib.suppress(AttributeError):  # a tokenizer with slots: computed again next time
        tokenizer._modelfleet_longest_token = longest
    return longest
