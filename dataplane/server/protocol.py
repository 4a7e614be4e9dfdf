"""OpenAI-compatible request and response models (the subset this server implements)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from modelfleet.dataplane.jsonpaths import first_bad_string, not_utf8
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields clients send that cannot change the answer: taken and dropped. Any other field this server does
# not implement is a 400 naming it (extra="forbid"), so that a client never silently gets a different
# answer than it asked for.
HARMLESS_FIELDS = frozenset(
    {
        "metadata",  # the client's own tags
        "store",  # OpenAI keeps the answer for its dashboard; nothing is kept here
        "service_tier",  # a billing and latency class
        "prompt_cache_key",  # a routing hint for OpenAI's prompt cache
        "safety_identifier",  # an end-user id for abuse reports
    }
)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    # The output always follows the schema (a grammar masks every step), so strict or not is the same.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text`, or JSON: any object (`json_object`) or one following a schema (`json_schema`), enforced
    token by token by the engine."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: give it with type 'json_schema', and only then")
        return self

    def structured(self) -> tuple[str, str] | None:
        """What the engine's SamplingParams.structured takes."""
        if self.type == "json_object":
            return ("json_object", "")
        if self.type == "json_schema" and self.json_schema is not None:
            return ("json_schema", json.dumps(self.json_schema.schema_))
        return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data: Any) -> Any:
        found = first_bad_string(data, not_utf8)
        if found:
            raise ValueError(f"{found}: contains a lone surrogate; send valid UTF-8 text")
        return data

    @model_validator(mode="before")
    @classmethod
    def _drop_harmless(cls, data: Any) -> Any:
        if isinstance(data, dict) and HARMLESS_FIELDS & data.keys():
            data = {k: v for k, v in data.items() if k not in HARMLESS_FIELDS}
        return data

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    # Engine extras that vLLM accepts too.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    # Token id (a JSON key, so a string) -> bias in [-100, 100], added to the logit before sampling.
    logit_bias: dict[int, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        for token, bias in (value or {}).items():
            if token < 0:
                raise ValueError(f"token id {token} must be >= 0")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {token} must be in [-100, 100], not {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; send echo=false and prepend the prompt yourself")
        return value


class TextPart(BaseModel):
    """The one content part this server reads; any other type (an image, audio) is refused, not dropped."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        """Name the bad part, rather than the union's first branch ("should be a valid string")."""
        if not isinstance(value, list):
            return value
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content[{index}].type: {kind!r} is not supported; send text parts only")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content[{index}].text: must be a string")
        return value

    def text(self) -> str:
        """Content as plain text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI's strict mode guarantees the schema: that needs constrained decoding, so it is refused.
    strict: Literal[False] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    # "auto" (the default with tools), "none", or forced: "required" (at least one call) or a named
    # function. A forced choice constrains decoding to the calls' JSON (engine/structured.py).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # False: at most one call (enforced under a forced choice; with "auto" the model decides).
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_choice(cls, value: Any) -> Any:
        """One message naming the field, rather than one per branch of the union."""
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            try:
                return NamedToolChoice.model_validate(value)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"{where}: {err['msg']}" if where else err["msg"]) from None
        raise ValueError(f"{value!r} must be 'none', 'auto', 'required' or a named function")

    @model_validator(mode="after")
    def _tools_make_sense(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(names) != len(set(names)):
            raise ValueError("tools: function names must be unique")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and not names:
            raise ValueError("tool_choice: forces a call, but no tools are given")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: names {self.tool_choice.function.name!r}, which is not in tools")
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with a tool_choice that forces a call")
        return self

    def offered_tools(self) -> set[str]:
        """Names of the functions the model may call in this answer (none with tool_choice 'none')."""
        if self.tool_choice == "none":
            return set()
        return {t.function.name for t in self.tools or ()}

    def forced_tool(self) -> str | None:
        """'*' when any call is forced ("required"), the function's name when one is named, else None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "*" if self.tool_choice == "required" else None

    def structured(self) -> tuple[str, str] | None:
        """The engine's constraint (SamplingParams.structured): the response format's, or the forced calls'.
        A named function: its arguments object. "required": a list of {"name", "parameters"} calls."""
        forced = self.forced_tool()
        if forced is None:
            return self.response_format.structured() if self.response_format else None
        specs = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or ()}
        if forced != "*":
            return ("json_schema", json.dumps(specs[forced]))
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in specs.items()
        ]
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if self.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ("json_schema", json.dumps(calls))


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "modelfleet"
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
