"""Domain errors of the server, each mapped once onto an HTTP status and OpenAI's error body."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ClientGone(Exception):
    """The client stopped taking a streamed answer that a stream relay was writing (its write failed or
    stalled past the send deadline): the request ends as a disconnect does."""


class ServerError(Exception):
    """Base: a request failed with a reason the client can read."""

    status = 500
    type = "server_error"
    code: str | None = None
    # Set where the request was counted under its model's labels (the facade, a Generation), so that the
    # HTTP layer, which counts the refusals no model saw, does not count it again.
    counted: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


class BadRequest(ServerError):
    status = 400
    type = "invalid_request_error"


class PromptTooLong(BadRequest):
    code = "context_length_exceeded"


class ModelNotFound(ServerError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class Unauthorized(ServerError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class RateLimited(ServerError):
    """Per-key token rate, per-key concurrency or the bounded waiting queue said no."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, int(retry_after + 0.999)))})
        self.retry_after = retry_after


class ModelUnavailable(ServerError):
    """The version exists but cannot serve now (load failed, memory budget full, no weight)."""

    status = 503
    type = "service_unavailable"
    code = "model_unavailable"

    def __init__(self, message: str, *, code: str | None = None, retry_after: float | None = None) -> None:
        headers = {"Retry-After": str(max(1, int(retry_after + 0.999)))} if retry_after else None
        super().__init__(message, code=code, headers=headers)


class EngineFailure(ServerError):
    """The engine failed this one request (others go on)."""

    status = 500
    type = "server_error"
    code = "engine_error"


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """Pydantic/FastAPI validation errors -> one line naming the field, and the field as `param`."""
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    field = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return "request body is not valid JSON; send a JSON object", None
    if not loc and err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "request body must be a JSON object (send Content-Type: application/json)", None
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        message = "required field is missing"
    if err.get("type") == "extra_forbidden":
        message = "is not supported by this server; remove it"
    return (f"{field}: {message}" if field else message), field
