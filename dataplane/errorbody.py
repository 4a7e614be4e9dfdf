"""The one JSON error body of our HTTP services: OpenAI's, so the data plane stays OpenAI-compatible.

{"error": {"message", "type", "param", "code"}}: `code` is a short string naming the error (or null);
the HTTP status is the response's status, never repeated in the body. The control plane returns the same
shape (it may import the data plane; the reverse is not allowed, hence this module's home).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    message: str = Field(description="what is wrong and what to do, one line")
    type: str = Field(description="the error's class, e.g. invalid_request_error")
    param: str | None = Field(default=None, description="the field or path parameter at fault")
    code: str | None = Field(default=None, description="a short name of the error, e.g. not_found")


class ErrorBody(BaseModel):
    """Every error, in the OpenAI error format."""

    model_config = ConfigDict(extra="forbid", strict=True)

    error: ErrorDetail
