"""Inputs that once reached the database and came back as 5xx (on SQLite, PostgreSQL or both), racing
deletes that all claimed success, and tenant keys that could outlive every rotation."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from controlplane_factories import ADMIN, Factory
from fastapi.testclient import TestClient
from modelfleet.controlplane.api.handlers import error_code
from modelfleet.dataplane.errorbody import ErrorBody

API = "/api/v1"
INT32_MAX = 2**31 - 1


def assert_400_naming(response, param: str) -> None:
    assert response.status_code in (400, 422), response.text
    error = ErrorBody.model_validate(response.json()).error.model_dump()
    assert error["code"] == error_code(response.status_code)
    assert param in f"{error['param']} {error['message']}", error


@pytest.mark.parametrize("value", [INT32_MAX + 1, 2**63, 2**64])
def test_integers_beyond_the_columns_range_are_refused(client: TestClient, factory: Factory, value):
    tenant = factory.tenant()
    assert_400_naming(client.get(f"{API}/tenants", params={"offset": value}, headers=ADMIN), "offset")
    assert_400_naming(client.get(f"{API}/tenants/{tenant}/keys/{value}", headers=ADMIN), "key_id")
    body = {"name": factory.unique("team"), "token_rate_limit": value}
    assert_400_naming(client.post(f"{API}/tenants", json=body, headers=ADMIN), "token_rate_limit")
    patch = client.patch(f"{API}/tenants/{tenant}", json={"token_rate_limit": value}, headers=ADMIN)
    assert_400_naming(patch, "token_rate_limit")


def test_the_largest_values_in_range_are_stored(client: TestClient, factory: Factory):
    name = factory.unique("team")
    created = client.post(f"{API}/tenants", json={"name": name, "token_rate_limit": INT32_MAX}, headers=ADMIN)
    assert created.status_code == 201, created.text
    assert client.get(f"{API}/tenants/{name}", headers=ADMIN).json()["token_rate_limit"] == INT32_MAX
    page = client.get(f"{API}/tenants", params={"offset": INT32_MAX}, headers=ADMIN)
    assert page.status_code == 200 and page.json()["data"] == []


def test_a_nul_byte_anywhere_is_a_400(client: TestClient, factory: Factory):
    tenant = factory.tenant()
    model = factory.model(tenant)
    url = f"{API}/tenants/{tenant}/models/{model}/versions"
    body = {"version": "v1", "source": {"uri": "pvc://models/a\x00b"}}
    assert_400_naming(client.post(url, json=body, headers=ADMIN), "source.uri")
    assert_400_naming(client.get(f"{API}/tenants/bad%00name", headers=ADMIN), "NUL")
    assert_400_naming(client.get(f"{API}/audit", params={"action": "a\x00"}, headers=ADMIN), "NUL")
    assert client.get(f"{API}/tenants/{tenant}", headers=ADMIN).status_code == 200


def test_racing_deletes_of_one_version_succeed_once(client: TestClient, factory: Factory):
    tenant = factory.tenant()
    model = factory.model(tenant)
    factory.version(tenant, model, "v1")
    factory.version(tenant, model, "v2")
    url = f"{API}/tenants/{tenant}/models/{model}/versions/v2"
    start = threading.Barrier(8)

    def delete(_: int) -> int:
        start.wait()
        return client.delete(url, headers=ADMIN).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(delete, range(8)))
    assert codes.count(204) == 1 and set(codes) <= {204, 404, 409}, codes
    audit = client.get(f"{API}/audit", params={"action": "version.delete", "limit": 500}, headers=ADMIN)
    deletes = [e for e in audit.json()["data"] if e["target"] == f"{tenant}/{model}@v2"]
    assert len(deletes) == 1, deletes


def test_a_tenant_key_cannot_mint_a_key_that_outlives_it(client: TestClient, factory: Factory):
    tenant = factory.tenant()
    minter = factory.key(tenant, expires_in_days=30)
    headers = {"Authorization": f"Bearer {minter['key']}"}
    url = f"{API}/tenants/{tenant}/keys"
    for name, days in (("forever", None), ("longer", 31)):
        made = client.post(url, json={"name": name, "expires_in_days": days}, headers=headers)
        assert made.status_code == 201, made.text
        assert made.json()["expires_at"] == minter["expires_at"]
    within = client.post(url, json={"name": "within", "expires_in_days": 29}, headers=headers)
    assert within.status_code == 201, within.text
    assert within.json()["expires_at"] < minter["expires_at"]


def test_only_the_admin_mints_keys_that_never_expire(client: TestClient, factory: Factory):
    tenant = factory.tenant()
    url = f"{API}/tenants/{tenant}/keys"
    service = client.post(url, json={"name": "svc", "expires_in_days": None}, headers=ADMIN)
    assert service.status_code == 201 and service.json()["expires_at"] is None
    headers = {"Authorization": f"Bearer {service.json()['key']}"}
    forever = client.post(url, json={"name": "forever", "expires_in_days": None}, headers=headers)
    assert forever.status_code == 403, forever.text
    assert "expires_in_days" in forever.json()["error"]["message"]
    assert client.post(url, json={"name": "year", "expires_in_days": 365}, headers=headers).status_code == 201
