"""The control plane's app factory and its command, `modelfleet controlplane`."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from modelfleet.controlplane import cluster as cluster_module
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.deps import DatabaseNotReady
from modelfleet.controlplane.api.main import api_router
from modelfleet.controlplane.cluster import Cluster
from modelfleet.controlplane.core import db, telemetry
from modelfleet.controlplane.core.config import Settings
from modelfleet.controlplane.errors import ControlPlaneError
from modelfleet.controlplane.models import utcnow
from opentelemetry.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm.exc import StaleDataError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

log = logging.getLogger("modelfleet.controlplane")


def error_body(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    """The OpenAI error body, used for every error this service returns."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


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
        log.warning("could not audit a refused call: %s", _first_line(error))


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
            log.warning("database unavailable: %s", _first_line(error))
            return error_body(503, "database unavailable; retry shortly", "service_unavailable")
        log.exception("database error")
        return error_body(500, "internal database error", "internal_error")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_body(error.status_code, str(error.detail), error_type)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def try_migrate(app: FastAPI) -> bool:
    """`alembic upgrade head` once; False when the database is unreachable (other failures raise)."""
    state = app.state
    try:
        db.run_migrations(state.engine)
    except sa_exc.SQLAlchemyError as error:
        if not db.is_unavailable(error):
            raise
        state.migration_error = f"database unreachable at start-up ({_first_line(error)})"
        log.error("%s; retrying every %.0fs", state.migration_error, state.settings.migrate_retry_s)
        return False
    state.migrated, state.migration_error = True, None
    return True


def keep_migrating(app: FastAPI, stop: threading.Event) -> None:
    # The process stays up and answers 503 until the database is back, then serves normally.
    while not stop.wait(app.state.settings.migrate_retry_s):
        if try_migrate(app):
            log.info("database reachable again; schema at head")
            return


def sync_expired_keys(app: FastAPI, *, since: datetime, until: datetime) -> int:
    """Drop keys that expired in (since, until] from their tenants' Secrets; the number of tenants synced.

    The data plane's key file has no expiry, so an expired key must leave the Secret to stop working there.
    """
    with app.state.sessionmaker() as session:
        tenants = crud.tenants_with_keys_expired_between(session, since=since, until=until)
        for tenant in tenants:
            app.state.cluster.apply_keys(tenant, crud.usable_key_prefixes(session, tenant=tenant))
    return len(tenants)


def keep_expiring_keys(app: FastAPI, stop: threading.Event) -> None:
    since = utcnow()
    while not stop.wait(app.state.settings.key_sync_interval_s):
        until = utcnow()
        try:
            if app.state.migrated:
                synced = sync_expired_keys(app, since=since, until=until)
                if synced:
                    log.info("removed expired API keys from %d tenant Secret(s)", synced)
                since = until
        except (sa_exc.SQLAlchemyError, ControlPlaneError) as error:
            log.warning("expired-key sync failed, will retry: %s", _first_line(error))


def create_app(
    settings: Settings | None = None,
    *,
    cluster: Cluster | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The app; `tracer_provider` replaces the global one (which `setup_tracing` sets from OTEL_*)."""
    settings = settings or Settings()
    engine = db.make_engine(settings)
    if tracer_provider is None:
        telemetry.setup_tracing()
    telemetry.instrument_engine(engine, tracer_provider)
    # FastAPI traces requests itself (server, dependency and endpoint spans) where it knows how to.
    native_tracing = "telemetry" in inspect.signature(FastAPI).parameters
    tracing = (
        {"telemetry": {"tracer_provider": tracer_provider}} if native_tracing and tracer_provider else {}
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log.info("database %s", engine.url.render_as_string(hide_password=True))
        log.info("cluster: %s", app.state.cluster.describe())
        stop = threading.Event()
        workers = []
        if not try_migrate(app):
            workers.append(
                threading.Thread(target=keep_migrating, args=(app, stop), daemon=True, name="migrate")
            )
        if app.state.cluster.name != "none":
            workers.append(
                threading.Thread(target=keep_expiring_keys, args=(app, stop), daemon=True, name="keys")
            )
        for worker in workers:
            worker.start()
        yield
        stop.set()
        for worker in workers:
            worker.join(timeout=5)
        engine.dispose()

    app = FastAPI(
        title="modelfleet control plane",
        version="v1",
        description="Tenants, API keys, the model registry and traffic rollouts of a modelfleet fleet.",
        lifespan=lifespan,
        **tracing,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = db.make_sessionmaker(engine)
    app.state.cluster = cluster if cluster is not None else cluster_module.connect(settings)
    app.state.migrated = False
    app.state.migration_error = "migrations have not run yet"
    app.add_middleware(telemetry.MetricsMiddleware)
    add_error_handlers(app)
    app.include_router(api_router)

    @app.get("/health", tags=["system"])
    def health() -> dict[str, str]:
        return {"status": "ok", "cluster": app.state.cluster.name}

    @app.get("/ready", tags=["system"])
    def ready() -> JSONResponse:
        if not app.state.migrated:
            return error_body(503, f"database not ready: {app.state.migration_error}", "service_unavailable")
        if not db.database_is_up(engine):
            return error_body(503, "database unavailable; retry shortly", "service_unavailable")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["system"], include_in_schema=False)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def load_settings() -> Settings:
    """Settings from the environment; a bad value becomes one line naming the variable."""
    try:
        return Settings()
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "settings"
        name = field if field.startswith("MODELFLEET_") else f"MODELFLEET_{field.upper()}"
        message = first["msg"].removeprefix("Value error, ")
        raise SettingsError(message if message.startswith("MODELFLEET_") else f"{name}: {message}") from None


class SettingsError(ValueError):
    """A setting that prevents start-up."""


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = load_settings()
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    host = args.host or settings.host
    port = args.port or settings.port
    try:
        app = create_app(settings)
    except ControlPlaneError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return 2
    if args.migrate_only:
        ok = try_migrate(app)
        print("schema at head" if ok else f"error: {app.state.migration_error}", file=sys.stderr)
        app.state.engine.dispose()
        return 0 if ok else 1
    uvicorn.run(app, host=host, port=port, log_level=args.log_level, access_log=False)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "controlplane",
        help="run the control plane: tenants, API keys, model registry, rollouts",
        description="Serve the control plane's REST API (/api/v1, OpenAPI at /docs). Settings come from "
        "MODELFLEET_* variables (MODELFLEET_DATABASE_URL or DATABASE_URL, MODELFLEET_ADMIN_KEY, ...).",
    )
    parser.add_argument(
        "--host", default=None, help="address to listen on (default: MODELFLEET_HOST or 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=None, help="port (default: MODELFLEET_PORT or 8080)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--migrate-only",
        action="store_true",
        help="bring the database schema to head (alembic upgrade head) and exit",
    )
    parser.set_defaults(func=serve)
