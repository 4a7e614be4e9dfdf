"""Error handlers: every error in the OpenAI error body, domain errors mapped once to their status, and
refused mutating calls audited for the admin."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.deps import DatabaseNotReady
from modelfleet.controlplane.core import db, telemetry
from modelfleet.controlplane.errors import ControlPlaneError
from modelfleet.dataplane.errorbody import ErrorBody, ErrorDetail
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm.exc import StaleDataError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

log = logging.getLogger("modelfleet.controlplane")


# The body's `code` names the error in words; the status stays the HTTP status only.
CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "cluster_unavailable",
    503: "service_unavailable",
}


def error_code(status: int) -> str:
    if status in CODES:
        return CODES[status]
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "error"


def error_body(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    """The OpenAI error body (dataplane/errorbody.py), used for every error this service returns."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    detail = ErrorDetail(message=message, type=error_type, param=param, code=error_code(status))
    return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status, headers=headers)


def _field(loc: tuple[Any, ...]) -> str:
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)
    return ".".join(str(p) for p in parts) or "body"


MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def record_refusal(request: Request, status: int, message: str) -> None:
    """Audit a mutating call that an authenticated caller made and that was refused.

    Such events are the admin's (tenant None): they name what was tried, which may be another tenant's.
    Recording must never turn the refusal into a different error, so failures here are only logged.
    """
    principal = getattr(request.state, "principal", None)
    if request.method not in MUTATING or principal is None:
        return
    try:
        with request.app.state.sessionmaker() as session, session.begin():
            detail = {"status": status, "message": message, "caller_tenant": principal.tenant}
            target = f"{request.method} {request.url.path}"
            crud.record_audit(
                session, actor=principal.actor, tenant=None, action="refused", target=target, detail=detail
            )
    except sa_exc.SQLAlchemyError as error:
        log.warning("could not audit a refused call: %s", first_line(error))


async def refusal(request: Request, status: int, message: str, error_type: str, param: str | None = None):
    await run_in_threadpool(record_refusal, request, status, message)
    return error_body(status, message, error_type, param)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ControlPlaneError)
    async def _domain(request: Request, error: ControlPlaneError) -> JSONResponse:
        message = error.message
        if error.status_code == 422 and error.param:  # like request validation: the field comes first
            message = f"{error.param}: {message}"
        return await refusal(request, error.status_code, message, error.error_type, error.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        field = _field(tuple(errors[0]["loc"]))
        message = errors[0]["msg"].removeprefix("Value error, ")
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return await refusal(request, 422, f"{field}: {message}{more}", "invalid_request_error", field)

    @app.exception_handler(StaleDataError)
    async def _stale(request: Request, error: StaleDataError) -> JSONResponse:
        message = "changed by another request at the same time; read it again and retry"
        return await refusal(request, 409, message, "conflict_error")

    @app.exception_handler(DatabaseNotReady)
    async def _not_ready(request: Request, error: DatabaseNotReady) -> JSONResponse:
        telemetry.DB_UNAVAILABLE.inc()
        return error_body(503, f"database not ready: {error}; retry shortly", "service_unavailable")

    @app.exception_handler(sa_exc.SQLAlchemyError)
    async def _database(request: Request, error: sa_exc.SQLAlchemyError) -> JSONResponse:
        if isinstance(error, sa_exc.IntegrityError):
            message = "conflicts with an existing record; read it again and retry"
            return await refusal(request, 409, message, "conflict_error")
        if db.is_unavailable(error):
            telemetry.DB_UNAVAILABLE.inc()
            log.warning("database unavailable: %s", first_line(error))
            return error_body(503, "database unavailable; retry shortly", "service_unavailable")
        log.exception("database error")
        return error_body(500, "internal database error", "internal_error")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_body(error.status_code, str(error.detail), error_type)


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
