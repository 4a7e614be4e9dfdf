"""Work beside the requests: the schema brought to head (or, where another process migrates, waited for)
while the database is away or behind at start-up, and expired API keys taken out of the tenants' key
Secrets."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

from fastapi import FastAPI
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.handlers import first_line
from modelfleet.controlplane.core import db
from modelfleet.controlplane.errors import ControlPlaneError
from modelfleet.controlplane.models import utcnow
from sqlalchemy import exc as sa_exc

log = logging.getLogger("modelfleet.controlplane")

MIGRATE_HINT = "run `modelfleet controlplane --migrate-only` (the chart's migration Job)"


def try_migrate(app: FastAPI, *, retrying: bool = True) -> bool:
    """`alembic upgrade head` once; False when the database is unreachable (other failures raise).

    `retrying` False: the caller reports the failure itself (`--migrate-only` exits; its Job retries).
    """
    state = app.state
    try:
        db.run_migrations(state.engine)
    except sa_exc.SQLAlchemyError as error:
        if not db.is_unavailable(error):
            raise
        state.migration_error = f"database unreachable at start-up ({first_line(error)})"
        if retrying:
            log.error("%s; retrying every %.0fs", state.migration_error, state.settings.migrate_retry_s)
        return False
    state.migrated, state.migration_error = True, None
    return True


def check_schema(app: FastAPI) -> bool:
    """True when the schema is at this release's head. Never migrates: with migrate_on_start off, one
    Job per release does, and replicas racing each other to migrate is what that setting prevents."""
    state = app.state
    try:
        schema = db.schema_state(state.engine)
    except sa_exc.SQLAlchemyError as error:
        if not db.is_unavailable(error):
            raise
        _waiting(app, f"database unreachable ({first_line(error)})")
        return False
    if schema.at_head:
        state.migrated, state.migration_error = True, None
        return True
    at, needs = _revisions(schema.current), _revisions(schema.heads)
    if schema.unknown:
        # Migrating cannot help: this release's migrations do not know the revision (a rollback across
        # a migration needs `alembic downgrade` with the newer release first).
        message = (
            f"database schema is at {at}, newer than this release knows (it needs {needs}): "
            "run the release that migrated it"
        )
    else:
        message = f"database schema is at {at}, this release needs {needs}: {MIGRATE_HINT}"
    _waiting(app, message)
    return False


def _revisions(revisions: tuple[str, ...]) -> str:
    return ", ".join(revisions) if revisions else "none (an empty database)"


def _waiting(app: FastAPI, message: str) -> None:
    state = app.state
    if message != state.migration_error:  # said once, not at every retry
        log.error("%s; checking again every %.0fs", message, state.settings.migrate_retry_s)
    state.migration_error = message


def start_schema(app: FastAPI) -> bool:
    """What a replica does at start: migrate, or with migrate_on_start off only check the schema."""
    return try_migrate(app) if app.state.settings.migrate_on_start else check_schema(app)


def keep_migrating(
    app: FastAPI, stop: threading.Event, attempt: Callable[[FastAPI], bool] = start_schema
) -> None:
    # The process stays up and answers 503 until the schema is at head, then serves normally.
    while not stop.wait(app.state.settings.migrate_retry_s):
        if attempt(app):
            log.info("database schema at head; serving")
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
    since = datetime(
        1970, 1, 1, tzinfo=UTC
    )  # the first pass also catches keys that expired while we were down
    while not stop.wait(app.state.settings.key_sync_interval_s):
        until = utcnow()
        try:
            if app.state.migrated:
                synced = sync_expired_keys(app, since=since, until=until)
                if synced:
                    log.info("removed expired API keys from %d tenant Secret(s)", synced)
                since = until
        except (sa_exc.SQLAlchemyError, ControlPlaneError) as error:
            log.warning("expired-key sync failed, will retry: %s", first_line(error))
