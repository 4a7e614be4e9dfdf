"""Alembic environment: migrations run on the connection the control plane hands over (core/db.py)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from modelfleet.controlplane.core.config import get_settings
from modelfleet.controlplane.models import Base
from sqlalchemy import create_engine

config = context.config
target_metadata = Base.metadata


def run_with(connection) -> None:
    # Batch mode lets later migrations alter tables on SQLite, which has no ALTER COLUMN.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run_with(connection)
        return
    # Run from the `alembic` command line: the same settings the server reads, and the ini's logging
    # (only here: inside the server it would replace the server's own logging set-up).
    if config.config_file_name:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    engine = create_engine(get_settings().database_url)
    with engine.begin() as connection:
        run_with(connection)
    engine.dispose()


if context.is_offline_mode():
    context.configure(url=get_settings().database_url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_online()
