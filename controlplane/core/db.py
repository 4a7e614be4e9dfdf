"""Engine, sessions and migrations. The schema changes only through Alembic (`alembic upgrade head`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from modelfleet.controlplane.core.config import Settings
from sqlalchemy import Engine, create_engine, event, exc, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

ALEMBIC_INI = Path(__file__).resolve().parents[1] / "alembic.ini"


def make_engine(settings: Settings) -> Engine:
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, pool_pre_ping=True
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(
        url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_pool_size,
        pool_pre_ping=True,  # a connection that died with the server is replaced, not handed out
        pool_timeout=settings.db_connect_timeout_s,
        connect_args={"connect_timeout": settings.db_connect_timeout_s},
    )


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")  # SQLite ignores foreign keys unless asked
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the one writer
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def alembic_config() -> Config:
    # Loaded by path so that it works from an installed wheel as well as from the checkout.
    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(ALEMBIC_INI.parent / "alembic"))
    return config


def run_migrations(engine: Engine) -> None:
    """`alembic upgrade head` on this engine's database."""
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


@dataclass(frozen=True)
class SchemaState:
    current: tuple[str, ...]  # the database's revisions; () when it is empty
    heads: tuple[str, ...]  # what this release's migrations end at
    unknown: tuple[str, ...]  # current revisions this release lacks: a later release migrated it

    @property
    def at_head(self) -> bool:
        return set(self.current) == set(self.heads)


def head_revisions() -> tuple[str, ...]:
    """Where this release's migrations end."""
    return tuple(sorted(ScriptDirectory.from_config(alembic_config()).get_heads()))


def schema_state(engine: Engine) -> SchemaState:
    """Where the database's schema stands against this release's migrations; only reads."""
    script = ScriptDirectory.from_config(alembic_config())
    known = {revision.revision for revision in script.walk_revisions()}
    with engine.connect() as connection:
        current = tuple(sorted(MigrationContext.configure(connection).get_current_heads()))
    return SchemaState(
        current=current,
        heads=head_revisions(),
        unknown=tuple(r for r in current if r not in known),
    )


def database_is_up(engine: Engine) -> bool:
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return True
    except exc.SQLAlchemyError:
        return False


def is_unavailable(error: BaseException) -> bool:
    """True when the database cannot be reached (as opposed to a bad query or a constraint)."""
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    # TimeoutError: the pool waited for a free connection in vain.
    return isinstance(error, exc.OperationalError | exc.InterfaceError | exc.TimeoutError)
