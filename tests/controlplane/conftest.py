"""Fixtures of the control-plane tests: a database on SQLite and on a throwaway PostgreSQL, an app over
an in-memory Kubernetes object store, and factories that make test data through the API."""

from __future__ import annotations

from collections.abc import Iterator

import pgserver
import pytest
from controlplane_factories import Factory, MemoryStore, make_settings
from fastapi.testclient import TestClient
from modelfleet.controlplane.cluster import KubernetesCluster
from modelfleet.controlplane.core import db
from modelfleet.controlplane.main import create_app

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[pgserver.PostgresServer]:
    reason = pgserver.missing_reason()
    if reason:
        pytest.skip(reason)
    server = pgserver.PostgresServer()
    yield server
    server.close()


@pytest.fixture(scope="session", params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path_factory) -> str:
    """A database migrated once per backend: a SQLite file, then one on the throwaway PostgreSQL.

    Tests share it and keep apart through unique names (the factories make them), which is what
    many tenants on one control plane look like anyway. Each test's app still runs the start-up
    migration, which finds the schema at head; test_controlplane_migrations.py starts from empty.
    """
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite')}/controlplane.db"
    else:
        server: pgserver.PostgresServer = request.getfixturevalue("postgres_server")
        url = server.create_database("controlplane")
    migrate(url)
    return url


def migrate(url: str) -> None:
    engine = db.make_engine(make_settings(url))
    db.run_migrations(engine)
    engine.dispose()


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def client(database_url: str, store: MemoryStore) -> Iterator[TestClient]:
    cluster = KubernetesCluster(store, where="(in-memory test store)")
    with TestClient(create_app(make_settings(database_url), cluster=cluster)) as test_client:
        yield test_client


@pytest.fixture
def factory(client: TestClient) -> Factory:
    return Factory(client)
