"""Migrations run once per release, by `modelfleet controlplane --migrate-only` (the chart's Job): a
replica with migrate_on_start off never changes the schema, answers 503 saying what to run while the
schema is behind, and serves once it is at head, without a restart. On SQLite and PostgreSQL."""

from __future__ import annotations

import argparse
import time
import uuid

import pytest
from controlplane_factories import ADMIN, make_settings
from fastapi.testclient import TestClient
from modelfleet.controlplane.cli import add_parser
from modelfleet.controlplane.core import db
from modelfleet.controlplane.main import create_app
from sqlalchemy import inspect, text

API = "/api/v1"
HINT = "run `modelfleet controlplane --migrate-only` (the chart's migration Job)"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_database(request: pytest.FixtureRequest, tmp_path) -> str:
    """A database nobody has migrated."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/empty.db"
    server = request.getfixturevalue("postgres_server")
    return server.create_database(f"unmigrated_{uuid.uuid4().hex[:8]}")


def head() -> str:
    return ", ".join(db.head_revisions())


def tables(url: str) -> set[str]:
    engine = db.make_engine(make_settings(url))
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def migrate_only(monkeypatch: pytest.MonkeyPatch, url: str) -> int:
    """`modelfleet controlplane --migrate-only` in this process, configured as the chart's Job is."""
    monkeypatch.delenv("MODELFLEET_CONTROLPLANE_DATABASE_URL", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_MIGRATE_ON_START", "false")
    # The Job shares the Deployment's env, which asks for Kubernetes, but gets no credentials: migrating
    # must not need them.
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_CLUSTER", "kubernetes")
    parser = argparse.ArgumentParser(prog="modelfleet")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["controlplane", "--migrate-only", "--log-level", "warning"])
    return args.func(args)


def wait_for_ready(client: TestClient, timeout_s: float = 15) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        code = client.get("/ready").status_code
        if code == 200 or time.monotonic() > deadline:
            return code
        time.sleep(0.1)


def test_replica_waits_for_the_migration_job_then_serves(empty_database, monkeypatch, capsys):
    url = empty_database
    app = create_app(make_settings(url, migrate_on_start=False, migrate_retry_s=0.1))
    with TestClient(app) as client:
        expected = f"database schema is at none (an empty database), this release needs {head()}: {HINT}"
        ready = client.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["error"]["message"] == f"database not ready: {expected}"
        request = client.get(f"{API}/tenants", headers=ADMIN)
        assert request.status_code == 503
        assert expected in request.json()["error"]["message"]
        time.sleep(0.5)  # several retries: each only looks
        assert client.get("/ready").status_code == 503
        assert tables(url) <= {"alembic_version"}

        assert migrate_only(monkeypatch, url) == 0
        assert f"schema at head ({head()})" in capsys.readouterr().err

        # The same process, not restarted, notices and serves.
        assert wait_for_ready(client) == 200
        created = client.post(f"{API}/tenants", headers=ADMIN, json={"name": f"t{uuid.uuid4().hex[:8]}"})
        assert created.status_code == 201, created.text


def test_a_schema_newer_than_the_release_is_left_alone(tmp_path):
    """An older replica started after a newer release migrated: migrating cannot help, and it must not
    try (nor downgrade)."""
    url = f"sqlite:///{tmp_path}/newer.db"
    engine = db.make_engine(make_settings(url))
    db.run_migrations(engine)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'f00dcafe0001'"))
    app = create_app(make_settings(url, migrate_on_start=False, migrate_retry_s=0.1))
    with TestClient(app) as client:
        message = client.get("/ready").json()["error"]["message"]
        assert message == (
            f"database not ready: database schema is at f00dcafe0001, newer than this release knows "
            f"(it needs {head()}): run the release that migrated it"
        )
        time.sleep(0.3)
        assert client.get("/ready").status_code == 503
    assert db.schema_state(engine).current == ("f00dcafe0001",)
    engine.dispose()


def test_migrate_only_refuses_a_schema_it_does_not_know(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path}/newer.db"
    engine = db.make_engine(make_settings(url))
    db.run_migrations(engine)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'f00dcafe0001'"))
    engine.dispose()
    assert migrate_only(monkeypatch, url) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: migrations failed:") and "f00dcafe0001" in err


def test_migrate_on_start_is_the_default_and_migrates(tmp_path):
    url = f"sqlite:///{tmp_path}/dev.db"
    with TestClient(create_app(make_settings(url))) as client:
        assert client.get("/ready").status_code == 200
    assert "tenants" in tables(url)


# Nothing listens on port 1: connections are refused at once.
UNREACHABLE = "postgresql+psycopg://mf:pw@127.0.0.1:1/mf"


def test_migrate_only_against_an_unreachable_database_fails_in_one_line(monkeypatch, capsys, caplog):
    assert migrate_only(monkeypatch, UNREACHABLE) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: database unreachable"), lines
    # It exits (its Job retries): no promise of retrying in the log.
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_a_waiting_replica_says_when_the_database_is_unreachable():
    app = create_app(make_settings(UNREACHABLE, migrate_on_start=False, migrate_retry_s=0.1))
    with TestClient(app) as client:
        ready = client.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["error"]["message"].startswith("database not ready: database unreachable (")


def test_versions_recorded_before_0002_read_quantize_lm_head_false(empty_database):
    """A database at 0001 holding a version is upgraded in place: the version stays, not quantizing its
    lm_head (what it was built without)."""
    from alembic import command

    engine = db.make_engine(make_settings(empty_database))
    config = db.alembic_config()
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0001")
            now = "CURRENT_TIMESTAMP"
            connection.execute(
                text(
                    "INSERT INTO tenants (name, namespace, gpu_quota, token_rate_limit, allowed_models, "
                    "created_at, updated_at, version) "
                    f"VALUES ('acme', 'acme-ns', 0, 0, '[]', {now}, {now}, 1)"
                )
            )
            connection.execute(
                text(
                    "INSERT INTO models (tenant_id, name, description, accelerator, gpu_count, min_replicas, "
                    "max_replicas, sticky_by, loading, traffic, created_at, created_by, updated_at, version) "
                    f"VALUES (1, 'chat', '', 'cpu', 0, 1, 1, '', 'lazy', '[]', {now}, 'admin', {now}, 1)"
                )
            )
            connection.execute(
                text(
                    "INSERT INTO model_versions (model_id, name, source_uri, source_format, quantization, "
                    "targets, metadata, created_at, created_by) VALUES (1, 'v1', 'pvc://m/v1', 'auto', "
                    f"'int8', '[]', '{{}}', {now}, 'admin')"
                )
            )
        db.run_migrations(engine)
        with engine.connect() as connection:
            rows = connection.execute(text("SELECT name, quantize_lm_head FROM model_versions")).all()
        assert [(name, bool(flag)) for name, flag in rows] == [("v1", False)]
        assert db.schema_state(engine).current == db.head_revisions()
    finally:
        engine.dispose()
