"""The control plane's app factory and what `modelfleet controlplane` runs (its parser: cli.py)."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from alembic.util import CommandError as AlembicError
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from modelfleet.controlplane import cluster as cluster_module
from modelfleet.controlplane.api.handlers import add_error_handlers, error_body
from modelfleet.controlplane.api.main import api_router
from modelfleet.controlplane.background import keep_expiring_keys, keep_migrating, start_schema, try_migrate
from modelfleet.controlplane.cluster import Cluster, NoCluster
from modelfleet.controlplane.core import db, telemetry
from modelfleet.controlplane.core.config import PREFIX, Settings
from modelfleet.controlplane.errors import ControlPlaneError
from modelfleet.dataplane.observability import configure_logging
from opentelemetry.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

log = logging.getLogger("modelfleet.controlplane")


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
        # Migrate, or (migrate_on_start off) wait for the release's migration Job; 503 until at head.
        if not start_schema(app):
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
        name = field if field.startswith(PREFIX) else f"{PREFIX}{field.upper()}"
        message = first["msg"].removeprefix("Value error, ")
        raise SettingsError(message if message.startswith("MODELFLEET_") else f"{name}: {message}") from None


class SettingsError(ValueError):
    """A setting that prevents start-up."""


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    configure_logging(args.log_level)
    try:
        settings = load_settings()
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    host = args.host or settings.host
    port = args.port or settings.port
    try:
        # Migrating needs only the database: the chart's Job runs without Kubernetes credentials.
        app = create_app(settings, cluster=NoCluster() if args.migrate_only else None)
    except ControlPlaneError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return 2
    if args.migrate_only:
        # Whatever MODELFLEET_CONTROLPLANE_MIGRATE_ON_START says: this is the process that migrates.
        try:
            if try_migrate(app, retrying=False):
                at = ", ".join(db.schema_state(app.state.engine).current)
                print(f"schema at head ({at})", file=sys.stderr)
                return 0
            print(f"error: {app.state.migration_error}", file=sys.stderr)
        except AlembicError as error:  # e.g. the database is at a revision this release does not know
            print(f"error: migrations failed: {error}", file=sys.stderr)
        finally:
            app.state.engine.dispose()
        return 1
    uvicorn.run(app, host=host, port=port, log_level=args.log_level, access_log=False)
    return 0
