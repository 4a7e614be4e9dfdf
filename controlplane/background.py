"""Work beside the requests: migrations retried while the database is away at start-up, and expired API
keys taken out of the tenants' key Secrets."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

from fastapi import FastAPI
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.handlers import first_line
from modelfleet.controlplane.core import db
from modelfleet.controlplane.errors import ControlPlaneError
from modelfleet.controlplane.models import utcnow
from sqlalchemy import exc as sa_exc

log = logging.getLogger("modelfleet.controlplane")


def try_migrate(app: FastAPI) -> bool:
    """`alembic upgrade head` once; False when the database is unreachable (other failures raise)."""
    state = app.state
    try:
        db.run_migrations(state.engine)
    except sa_exc.SQLAlchemyError as error:
        if not db.is_unavailable(error):
            raise
        state.migration_error = f"database unreachable at start-up ({first_line(error)})"
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
