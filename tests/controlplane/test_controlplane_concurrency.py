"""Concurrent writers and a database that goes away: optimistic locking loses no update, and an
unreachable database answers 503 while the process stays up and recovers."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from controlplane_factories import Factory, make_settings
from fastapi.testclient import TestClient
from modelfleet.controlplane import crud, schemas
from modelfleet.controlplane.cluster import NoCluster
from modelfleet.controlplane.main import create_app
from pgserver import PostgresServer
from sqlalchemy.orm.exc import StaleDataError

API = "/api/v1"
WRITERS = 8


@pytest.fixture
def served(client: TestClient, factory: Factory) -> tuple[str, dict[str, str]]:
    tenant, headers = factory.tenant_with_key()
    model = factory.model(tenant, headers)
    for version in ("a", "b", "c"):
        factory.version(tenant, model, version, headers)
    factory.traffic(tenant, model, {"a": 100}, headers)
    return f"{API}/tenants/{tenant}/models/{model}", headers


def split(i: int) -> list[dict[str, int | str]]:
    return [{"version": "a", "weight": 100 - i}, {"version": "b", "weight": i}]


def test_same_expected_version_exactly_one_writer_wins(client: TestClient, served):
    base, headers = served
    seen = client.get(base, headers=headers).json()["version"]
    start = threading.Barrier(WRITERS)

    def write(i: int) -> int:
        start.wait()
        body = {"traffic": split(i + 1), "expected_version": seen, "reason": f"writer {i}"}
        return client.post(f"{base}/traffic", json=body, headers=headers).status_code

    with ThreadPoolExecutor(WRITERS) as pool:
        codes = list(pool.map(write, range(WRITERS)))
    assert sorted(codes) == [200] + [409] * (WRITERS - 1), codes
    winner = codes.index(200)
    assert client.get(base, headers=headers).json()["traffic"] == split(winner + 1)
    rollouts = client.get(f"{base}/rollouts", headers=headers).json()
    assert rollouts["count"] == 2 and rollouts["data"][0]["reason"] == f"writer {winner}"


def test_parallel_updates_lose_nothing(client: TestClient, served):
    """Blind writers race; each answer is 200 or 409, and the history is one unbroken chain of splits
    ending at the model's current split, one rollout per 200: no write vanished."""
    base, headers = served
    start = threading.Barrier(WRITERS)

    def write(i: int) -> list[int]:
        start.wait()
        body = lambda n: {"traffic": split(1 + (i * 3 + n) % 99), "reason": f"{i}.{n}"}  # noqa: E731
        return [client.post(f"{base}/traffic", json=body(n), headers=headers).status_code for n in range(3)]

    with ThreadPoolExecutor(WRITERS) as pool:
        codes = [code for batch in pool.map(write, range(WRITERS)) for code in batch]
    assert set(codes) <= {200, 409}, codes
    print(f"blind writers: {codes.count(200)} applied, {codes.count(409)} refused as stale")
    history = client.get(f"{base}/rollouts", params={"limit": 500}, headers=headers).json()["data"][::-1]
    assert len(history) == 1 + codes.count(200)
    for before, after in itertools.pairwise(history):
        assert after["from_weights"] == before["to_weights"], (before, after)
    assert client.get(base, headers=headers).json()["traffic"] == history[-1]["to_weights"]


def test_stale_session_cannot_overwrite(client: TestClient, served):
    """Two sessions read the same model; the one that writes second matches no row and fails."""
    base, headers = served
    tenant_name, model_name = base.split("/")[4], base.split("/")[6]
    make_session = client.app.state.sessionmaker
    with make_session() as first, make_session() as second:
        tenant = crud.get_tenant(first, name=tenant_name)
        model_one = crud.get_model(first, tenant=tenant, name=model_name)
        model_two = crud.get_model(second, tenant=crud.get_tenant(second, name=tenant_name), name=model_name)
        update = schemas.TrafficUpdate(traffic=[{"version": "c", "weight": 100}])
        crud.set_traffic(first, model=model_one, tenant=tenant, update=update, actor="first")
        first.commit()
        with pytest.raises(StaleDataError):
            crud.set_traffic(second, model=model_two, tenant=tenant, update=update, actor="second")
        second.rollback()
    assert client.get(base, headers=headers).json()["traffic"] == [{"version": "c", "weight": 100}]


@pytest.fixture
def own_database(postgres_server: PostgresServer) -> Iterator[tuple[PostgresServer, str]]:
    url = postgres_server.create_database(f"outage_{uuid.uuid4().hex[:8]}")
    yield postgres_server, url
    if not _running(postgres_server):
        postgres_server.start()  # whatever the test did, later tests need the server


def _running(server: PostgresServer) -> bool:
    return (server.data / "postmaster.pid").exists()


def _wait_for(client: TestClient, path: str, status: int, timeout_s: float = 15) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        code = client.get(path).status_code
        if code == status or time.monotonic() > deadline:
            return code
        time.sleep(0.1)


@pytest.mark.postgres
def test_database_outage_gives_503_and_recovers(own_database):
    server, url = own_database
    app = create_app(make_settings(url), cluster=NoCluster())
    with TestClient(app) as client:
        factory = Factory(client)
        tenant, headers = factory.tenant_with_key()
        assert client.get(f"{API}/tenants/{tenant}/models", headers=headers).status_code == 200

        server.stop()
        down = client.get(f"{API}/tenants/{tenant}/models", headers=headers)
        assert down.status_code == 503, down.text
        assert down.json()["error"]["message"] == "database unavailable; retry shortly"
        assert client.get("/ready").status_code == 503
        assert client.get("/health").status_code == 200  # alive: not worth a restart

        server.start()
        assert client.get(f"{API}/tenants/{tenant}/models", headers=headers).status_code == 200
        assert client.get("/ready").status_code == 200


@pytest.mark.postgres
def test_start_with_the_database_down_then_migrate_when_it_is_back(own_database):
    server, url = own_database
    server.stop()
    app = create_app(make_settings(url, migrate_retry_s=0.2), cluster=NoCluster())
    with TestClient(app) as client:
        waiting = client.get(f"{API}/me", headers={"Authorization": "Bearer x"})
        assert waiting.status_code == 503 and "database not ready" in waiting.json()["error"]["message"]
        server.start()
        assert _wait_for(client, "/ready", 200) == 200
        factory = Factory(client)
        tenant, headers = factory.tenant_with_key()
        assert client.get(f"{API}/me", headers=headers).json()["tenant"] == tenant
