"""Authorization over the whole route table: without a key 401; a tenant's key on another tenant's
objects 404 (they look absent), on admin-only routes 403; and nothing of the other tenant changes.

The routes come from the app's OpenAPI document, so a new route without a case here fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from controlplane_factories import ADMIN, Factory, MemoryStore, bearer, make_settings
from fastapi.testclient import TestClient
from modelfleet.controlplane.cluster import KubernetesCluster
from modelfleet.controlplane.main import create_app

API = "/api/v1"
TENANT = f"{API}/tenants/{{tenant_name}}"
MODEL = f"{TENANT}/models/{{model_name}}"
VERSION = f"{MODEL}/versions/{{version_name}}"

# Every route: a body that would succeed for the owner, and what another tenant's key gets.
CASES: dict[tuple[str, str], tuple[dict[str, Any] | None, int]] = {
    ("POST", f"{API}/tenants"): ({"name": "stolen"}, 403),
    ("GET", f"{API}/tenants"): (None, 403),
    ("GET", TENANT): (None, 403),
    ("PATCH", TENANT): ({"gpu_quota": 99}, 403),
    ("DELETE", TENANT): (None, 403),
    ("POST", f"{TENANT}/keys"): ({"name": "mine-now"}, 404),
    ("GET", f"{TENANT}/keys"): (None, 404),
    ("GET", f"{TENANT}/keys/{{key_id}}"): (None, 404),
    ("DELETE", f"{TENANT}/keys/{{key_id}}"): (None, 404),
    ("POST", f"{TENANT}/models"): ({"name": "planted"}, 404),
    ("GET", f"{TENANT}/models"): (None, 404),
    ("GET", MODEL): (None, 404),
    ("PATCH", MODEL): ({"description": "defaced"}, 404),
    ("DELETE", MODEL): (None, 404),
    ("POST", f"{MODEL}/traffic"): ({"traffic": [{"version": "v2", "weight": 100}]}, 404),
    ("POST", f"{MODEL}/promote"): ({"version": "v2"}, 404),
    ("POST", f"{MODEL}/rollback"): ({}, 404),
    ("GET", f"{MODEL}/rollouts"): (None, 404),
    ("POST", f"{MODEL}/versions"): ({"version": "v9", "source": {"uri": "s3://evil/w"}}, 404),
    ("GET", f"{MODEL}/versions"): (None, 404),
    ("GET", VERSION): (None, 404),
    ("DELETE", VERSION): (None, 404),
    ("GET", f"{API}/audit"): (None, 200),  # allowed, but shows only the caller's own events
    ("GET", f"{API}/me"): (None, 200),
}


def _api_routes() -> list[tuple[str, str]]:
    app = create_app(make_settings("sqlite://"))
    paths = app.openapi()["paths"]
    app.state.engine.dispose()
    return sorted(
        (method.upper(), path) for path, ops in paths.items() if path.startswith(API) for method in ops
    )


ROUTES = _api_routes()


def test_every_route_has_a_case():
    assert set(ROUTES) == set(CASES), "add the new route to CASES with its expected answer"


@pytest.fixture(scope="module")
def client(database_url: str) -> Iterator[TestClient]:
    cluster = KubernetesCluster(MemoryStore(), where="(in-memory test store)")
    with TestClient(create_app(make_settings(database_url), cluster=cluster)) as test_client:
        yield test_client


def make_world(client: TestClient) -> dict[str, Any]:
    """Two tenants with a model of the same name each: the victim's is served, v1 -> v2."""
    factory = Factory(client)
    victim, victim_headers = factory.tenant_with_key(name=factory.unique("victim"))
    intruder, intruder_headers = factory.tenant_with_key(name=factory.unique("intruder"))
    model = factory.served_model(victim, victim_headers)
    factory.traffic(victim, model, {"v2": 100}, victim_headers)  # so that a rollback has a step to undo
    factory.model(intruder, intruder_headers, name=model)
    factory.version(intruder, model, "v1", intruder_headers)
    key_id = client.get(f"{API}/tenants/{victim}/keys", headers=ADMIN).json()["data"][0]["id"]
    params = {"tenant_name": victim, "model_name": model, "version_name": "v1", "key_id": key_id}
    return {
        "victim": victim,
        "victim_headers": victim_headers,
        "intruder_headers": intruder_headers,
        "params": params,
        "before": snapshot(client, victim),
    }


@pytest.fixture(scope="module")
def world(client: TestClient) -> dict[str, Any]:
    """One world for all intruder calls: each must leave it exactly as it was (checked after each)."""
    return make_world(client)


def snapshot(client: TestClient, tenant: str) -> dict[str, Any]:
    """Everything of a tenant that a call could change, read with the admin key."""
    base = f"{API}/tenants/{tenant}"
    models = client.get(f"{base}/models", headers=ADMIN).json()["data"]
    return {
        "tenant": client.get(base, headers=ADMIN).json(),
        "keys": client.get(f"{base}/keys", params={"include_revoked": True}, headers=ADMIN).json(),
        "models": models,
        "versions": {
            m["name"]: client.get(f"{base}/models/{m['name']}/versions", headers=ADMIN).json() for m in models
        },
        "rollouts": {
            m["name"]: client.get(f"{base}/models/{m['name']}/rollouts", headers=ADMIN).json() for m in models
        },
    }


def call(client: TestClient, method: str, path: str, params: dict[str, Any], headers: dict[str, str]):
    body, _ = CASES[(method, path)]
    return client.request(method, path.format(**params), json=body, headers=headers)


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p.removeprefix(API)}" for m, p in ROUTES])
def test_another_tenant_can_neither_see_nor_change(client: TestClient, world: dict[str, Any], method, path):
    answer = call(client, method, path, world["params"], world["intruder_headers"])
    expected = CASES[(method, path)][1]
    assert answer.status_code == expected, answer.text
    if expected == 200:
        assert world["victim"] not in answer.text
    else:
        error = answer.json()["error"]
        assert error["type"] == ("permission_error" if expected == 403 else "not_found_error")
    assert snapshot(client, world["victim"]) == world["before"]


def test_without_a_valid_key_every_route_is_401(client: TestClient, world: dict[str, Any]):
    for method, path in ROUTES:
        for headers in ({}, bearer("mf_abcdefgh_not-a-real-key"), {"Authorization": "Basic eDp5"}):
            answer = call(client, method, path, world["params"], headers)
            assert answer.status_code == 401, (method, path, headers, answer.text)
            assert answer.json()["error"]["type"] == "authentication_error"
    assert snapshot(client, world["victim"]) == world["before"]


def test_the_owner_is_allowed(client: TestClient):
    """The same calls with the victim's own key pass (admin-only routes still 403), so the 404s above come
    from the tenant boundary and not from bad requests. Deletes go last, in dependency order."""
    own = make_world(client)
    headers = bearer(Factory(client).key(own["victim"])["key"])  # the world's first key gets revoked
    deletes_last = sorted(ROUTES, key=lambda route: (route[0] == "DELETE", -len(route[1])))
    for method, path in deletes_last:
        answer = call(client, method, path, own["params"], headers)
        if CASES[(method, path)][1] == 403:
            assert answer.status_code == 403, (method, path)
        else:
            assert answer.status_code < 300, (method, path, answer.text)


def test_a_tenant_key_reads_only_its_own_audit_trail(client: TestClient, world: dict[str, Any]):
    """`?tenant=` is an admin filter: a tenant key naming another tenant still gets only its own events."""
    victim = world["victim"]
    assert client.get(f"{API}/audit", params={"tenant": victim}, headers=ADMIN).json()["count"] > 0
    intruder = client.get(f"{API}/me", headers=world["intruder_headers"]).json()["tenant"]
    for params in ({"tenant": victim}, {"tenant": victim, "action": "model.traffic"}, {}):
        answer = client.get(f"{API}/audit", params=params, headers=world["intruder_headers"])
        assert answer.status_code == 200, answer.text
        events = answer.json()["data"]
        assert victim not in answer.text
        assert {e["tenant"] for e in events} <= {intruder}
    own = client.get(f"{API}/audit", headers=world["intruder_headers"]).json()
    assert own["count"] > 0 and {e["tenant"] for e in own["data"]} == {intruder}


def test_a_missing_model_or_version_of_ones_own_tenant_is_a_404_naming_it(
    client: TestClient, world: dict[str, Any]
):
    params, headers = world["params"], world["victim_headers"]
    base = f"{API}/tenants/{params['tenant_name']}/models"
    for path, param in [
        (f"{base}/no-such-model", "model_name"),
        (f"{base}/{params['model_name']}/versions/no-such-version", "version_name"),
    ]:
        answer = client.get(path, headers=headers)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["param"] == param


def test_a_key_is_refused_from_the_instant_it_expires(client: TestClient, monkeypatch: pytest.MonkeyPatch):
    from datetime import UTC, datetime, timedelta

    from modelfleet.controlplane.api import deps
    from modelfleet.controlplane.models import ApiKey
    from sqlalchemy import update

    factory = Factory(client)
    tenant = factory.tenant()
    key = factory.key(tenant)
    with client.app.state.sessionmaker() as session, session.begin():
        session.execute(
            update(ApiKey)
            .where(ApiKey.id == key["id"])
            .values(expires_at=datetime.now(UTC) + timedelta(days=1))
        )
    with client.app.state.sessionmaker() as session:
        expires_at = session.get(ApiKey, key["id"]).expires_at
    monkeypatch.setattr(deps, "utcnow", lambda: expires_at - timedelta(microseconds=1))
    assert client.get(f"{API}/me", headers=bearer(key["key"])).status_code == 200
    monkeypatch.setattr(deps, "utcnow", lambda: expires_at)
    refused = client.get(f"{API}/me", headers=bearer(key["key"]))
    assert refused.status_code == 401 and "expired" in refused.json()["error"]["message"]
