"""The REST API end to end, on SQLite and on PostgreSQL (the `database_url` fixture runs each test twice)."""

from __future__ import annotations

import base64
import json
import logging
from datetime import UTC, datetime, timedelta

from controlplane_factories import ADMIN, PEPPER, Factory, MemoryStore, bearer, key_file, make_settings
from fastapi.testclient import TestClient
from modelfleet.controlplane.background import sync_expired_keys
from modelfleet.controlplane.cluster import NoCluster
from modelfleet.controlplane.core.security import hash_key, serving_digest
from modelfleet.controlplane.main import create_app
from modelfleet.controlplane.models import ApiKey
from modelfleet.dataplane.server.auth import KeyStore
from modelfleet.operator.validation import validate_inference_model, validate_model_version
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from sqlalchemy import select, update

API = "/api/v1"


def test_openapi_lists_the_resources_and_their_errors(client: TestClient):
    paths = client.get("/openapi.json").json()["paths"]
    traffic = paths[f"{API}/tenants/{{tenant_name}}/models/{{model_name}}/traffic"]["post"]
    assert {"200", "401", "404", "409", "422"} <= set(traffic["responses"])
    assert f"{API}/tenants/{{tenant_name}}/models/{{model_name}}/versions/{{version_name}}" in paths
    assert client.get("/ready").json() == {"status": "ready"}


def test_version_object_names_cannot_clash_across_models(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key()
    factory.model(tenant, headers, name="a")
    factory.model(tenant, headers, name="a-b")
    factory.version(tenant, "a", "b-c", headers)
    body = {"version": "c", "source": {"uri": "s3://w/c"}}
    clash = client.post(f"{API}/tenants/{tenant}/models/a-b/versions", json=body, headers=headers)
    assert clash.status_code == 409 and "'a-b-c'" in clash.json()["error"]["message"]


def test_tenant_lifecycle_writes_namespace_quota_and_key_secret(client: TestClient, factory: Factory, store):
    name = factory.tenant(gpu_quota=8, token_rate_limit=100_000, allowed_models=["chat*"])
    tenant = client.get(f"{API}/tenants/{name}", headers=ADMIN).json()
    assert (tenant["namespace"], tenant["gpu_quota"], tenant["allowed_models"]) == (name, 8, ["chat*"])
    assert store.find("Namespace", name) is not None
    quota = store.find("ResourceQuota", "modelfleet-quota", name)
    assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == "8"

    patched = client.patch(f"{API}/tenants/{name}", json={"gpu_quota": 2}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["gpu_quota"] == 2
    assert (
        store.find("ResourceQuota", "modelfleet-quota", name)["spec"]["hard"]["requests.nvidia.com/gpu"]
        == "2"
    )

    listed = client.get(f"{API}/tenants", headers=ADMIN).json()
    assert name in [t["name"] for t in listed["data"]] and listed["count"] >= 1

    assert client.delete(f"{API}/tenants/{name}", headers=ADMIN).status_code == 204
    assert client.get(f"{API}/tenants/{name}", headers=ADMIN).status_code == 404
    assert store.find("Namespace", name) is None


def test_duplicate_tenant_and_namespace_conflict(client: TestClient, factory: Factory):
    name = factory.tenant()
    again = client.post(f"{API}/tenants", json={"name": name}, headers=ADMIN)
    assert again.status_code == 409 and again.json()["error"]["param"] == "name"
    same_ns = client.post(
        f"{API}/tenants", json={"name": factory.unique("other"), "namespace": name}, headers=ADMIN
    )
    assert same_ns.status_code == 409 and same_ns.json()["error"]["param"] == "namespace"


def test_key_is_shown_once_stored_hashed_and_mirrored_as_digests(
    client: TestClient, factory: Factory, store, tmp_path
):
    tenant = factory.tenant(token_rate_limit=5000)
    created = factory.key(tenant, name="ci", expires_in_days=30)
    token = created["key"]
    assert token.startswith(f"mf_{created['prefix']}_")
    assert client.get(f"{API}/me", headers=bearer(token)).json()["tenant"] == tenant

    listed = client.get(f"{API}/tenants/{tenant}/keys", headers=bearer(token)).json()["data"]
    assert [k["prefix"] for k in listed] == [created["prefix"]]
    assert all("key" not in k for k in listed)  # never shown again
    one = client.get(f"{API}/tenants/{tenant}/keys/{created['id']}", headers=ADMIN).json()
    assert "key" not in one and one["expires_at"] is not None

    with client.app.state.sessionmaker() as session:
        row = session.scalar(select(ApiKey).where(ApiKey.prefix == created["prefix"]))
        stored = {c.key: getattr(row, c.key) for c in ApiKey.__mapper__.column_attrs}
    assert token not in repr(stored) and row.key_hash == hash_key(token, PEPPER)
    assert row.key_hash != serving_digest(token)  # the database alone cannot check a data-plane key

    secret = store.find("Secret", "modelfleet-api-keys", tenant)
    assert token not in json.dumps(secret)
    assert key_file(store, tenant) == [
        {"sha256": serving_digest(token), "name": created["prefix"], "tokens_per_minute": 5000}
    ]
    # The data plane's own parser accepts the file and finds the key by its digest.
    path = tmp_path / "keys"
    path.write_bytes(base64.b64decode(secret["data"]["keys"]))
    principal = KeyStore(path).authenticate(f"Bearer {token}")
    assert principal.key_id == created["prefix"] and principal.limits.tokens_per_minute == 5000


def test_tokens_never_reach_the_logs(client: TestClient, factory: Factory, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, SQL statements with their parameters included
    caplog.set_level(logging.DEBUG, logger="sqlalchemy")  # which sets itself to WARNING otherwise
    tenant = factory.tenant()
    created = factory.key(tenant)
    client.get(f"{API}/me", headers=bearer(created["key"]))
    client.get(f"{API}/me", headers=bearer(created["key"] + "x"))  # a wrong one is not logged either
    client.delete(f"{API}/tenants/{tenant}/keys/{created['id']}", headers=ADMIN)
    assert any("api_keys" in record.getMessage() for record in caplog.records)  # SQL was logged
    secret = created["key"].split("_", 2)[2]
    assert secret not in caplog.text


def test_revoked_and_expired_keys_are_refused_and_leave_the_secret(
    client: TestClient, factory: Factory, store: MemoryStore
):
    tenant = factory.tenant()
    keep, drop = factory.key(tenant), factory.key(tenant)
    revoked = client.delete(f"{API}/tenants/{tenant}/keys/{drop['id']}", headers=bearer(keep["key"]))
    assert revoked.status_code == 204
    refused = client.get(f"{API}/me", headers=bearer(drop["key"]))
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    assert refused.headers["www-authenticate"] == "Bearer"
    assert [entry["name"] for entry in key_file(store, tenant)] == [keep["prefix"]]

    past = datetime.now(UTC) - timedelta(seconds=1)
    with client.app.state.sessionmaker() as session, session.begin():
        session.execute(update(ApiKey).where(ApiKey.id == keep["id"]).values(expires_at=past))
    expired = client.get(f"{API}/me", headers=bearer(keep["key"]))
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]
    synced = sync_expired_keys(client.app, since=past - timedelta(minutes=1), until=datetime.now(UTC))
    assert synced >= 1 and key_file(store, tenant) == []
    with_all = client.get(f"{API}/tenants/{tenant}/keys", params={"include_revoked": True}, headers=ADMIN)
    assert with_all.json()["count"] == 2


def test_concurrent_key_changes_keep_every_entry(client: TestClient, factory: Factory, store: MemoryStore):
    """A Secret write that lost a race is refused (resourceVersion) and redone on the fresh copy."""
    tenant = factory.tenant()
    first = factory.key(tenant)
    real_get = store.get
    raced = []

    def get_then_someone_else_writes(*args):
        found = real_get(*args)
        if args[1] == "Secret" and not raced:
            raced.append(True)
            secret = real_get(*args)
            store.apply({**secret, "metadata": {**secret["metadata"], "resourceVersion": None}})
        return found

    store.get = get_then_someone_else_writes
    second = factory.key(tenant)
    assert raced and {e["name"] for e in key_file(store, tenant)} == {first["prefix"], second["prefix"]}


def test_missing_and_wrong_keys_are_401(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key()
    assert client.get(f"{API}/tenants/{tenant}/models").status_code == 401
    token = headers["Authorization"].split()[1]
    for wrong in ("nonsense", token[:-2] + "xx", "mf_zzzzzzzz_abc"):
        answer = client.get(f"{API}/tenants/{tenant}/models", headers=bearer(wrong))
        assert answer.status_code == 401, wrong
        assert answer.json()["error"]["type"] == "authentication_error"


def test_model_create_list_filter_paginate(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key()
    for i in range(5):
        factory.model(tenant, headers, name=f"chat-{i}", hardware={"accelerator": "nvidia-h100", "count": 2})
    factory.model(tenant, headers, name="embedder", hardware={"accelerator": "cpu"})
    url = f"{API}/tenants/{tenant}/models"
    page = client.get(url, params={"limit": 2, "offset": 1}, headers=headers).json()
    assert page["count"] == 6 and [m["name"] for m in page["data"]] == ["chat-1", "chat-2"]
    by_name = client.get(url, params={"name_contains": "chat"}, headers=headers).json()
    assert by_name["count"] == 5
    by_hw = client.get(url, params={"accelerator": "cpu"}, headers=headers).json()
    assert [m["name"] for m in by_hw["data"]] == ["embedder"]
    one = client.get(f"{url}/chat-0", headers=headers).json()
    assert one["hardware"] == {"accelerator": "nvidia-h100", "count": 2} and one["traffic"] == []
    assert one["created_by"].startswith(f"{tenant}/key:")
    assert client.get(f"{url}/nope", headers=headers).status_code == 404
    assert client.post(url, json={"name": "chat-0"}, headers=headers).status_code == 409


def test_allowed_models_limit_what_a_tenant_may_create(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key(allowed_models=["chat-*"])
    url = f"{API}/tenants/{tenant}/models"
    assert client.post(url, json={"name": "chat-small"}, headers=headers).status_code == 201
    refused = client.post(url, json={"name": "image-gen"}, headers=headers)
    assert refused.status_code == 403 and "image-gen" in refused.json()["error"]["message"]


def test_versions_lineage_filters_and_delete_rules(client: TestClient, factory: Factory, store):
    tenant, headers = factory.tenant_with_key()
    model = factory.model(tenant, headers)
    digest = "a" * 64
    v1 = factory.version(tenant, model, "v1", headers, source={"uri": "s3://bucket/v1", "sha256": digest})
    assert v1["source"]["sha256"] == digest and v1["parent"] is None and v1["weight"] == 0
    factory.version(tenant, model, "v2", headers, parent="v1", quantization="fp8", metadata={"run": 7})
    factory.version(tenant, model, "v3", headers, parent="v1")
    url = f"{API}/tenants/{tenant}/models/{model}/versions"
    children = client.get(url, params={"parent": "v1"}, headers=headers).json()
    assert [v["version"] for v in children["data"]] == ["v2", "v3"]
    fp8 = client.get(url, params={"quantization": "fp8"}, headers=headers).json()["data"]
    assert [(v["version"], v["metadata"]) for v in fp8] == [("v2", {"run": 7})]
    bad_parent = client.post(
        url, json={"version": "v4", "source": {"uri": "s3://b/v4"}, "parent": "v9"}, headers=headers
    )
    assert bad_parent.status_code == 422 and bad_parent.json()["error"]["param"] == "parent"

    body = store.find("ModelVersion", f"{model}-v2", tenant)
    assert validate_model_version(body).spec.quantization == "fp8"
    assert not body["spec"].get("quantizeLmHead")
    v5 = factory.version(tenant, model, "v5", headers, quantization="int8", quantize_lm_head=True)
    assert v5["quantize_lm_head"] and not v1["quantize_lm_head"]
    spec = validate_model_version(store.find("ModelVersion", f"{model}-v5", tenant)).spec
    assert (spec.quantization, spec.quantize_lm_head) == ("int8", True)
    no_quantization = client.post(
        url, json={"version": "v6", "source": {"uri": "s3://b/v6"}, "quantize_lm_head": True}, headers=headers
    )
    assert no_quantization.status_code == 422
    assert no_quantization.json()["error"]["param"] == "quantize_lm_head"
    assert "quantization int8 or fp8" in no_quantization.json()["error"]["message"]

    factory.traffic(tenant, model, {"v1": 100}, headers)
    busy = client.delete(f"{url}/v1", headers=headers)
    assert busy.status_code == 409 and "100%" in busy.json()["error"]["message"]
    assert client.delete(f"{url}/v2", headers=headers).status_code == 204
    assert client.get(f"{url}/v2", headers=headers).status_code == 404
    assert store.find("ModelVersion", f"{model}-v2", tenant) is None


def test_traffic_promote_rollback_history(client: TestClient, factory: Factory, store):
    tenant, headers = factory.tenant_with_key()
    model = factory.model(tenant, headers, sticky_by="user")
    assert store.find("InferenceModel", model, tenant) is None  # no split yet: no CR
    factory.version(tenant, model, "v1", headers)
    factory.version(tenant, model, "v2", headers)
    base = f"{API}/tenants/{tenant}/models/{model}"

    first = factory.traffic(tenant, model, {"v1": 100}, headers, reason="launch")
    canary = factory.traffic(tenant, model, {"v1": 90, "v2": 10}, headers, reason="canary")
    assert canary["version"] == first["version"] + 1
    cr = validate_inference_model(store.find("InferenceModel", model, tenant))
    assert [(t.version, t.weight) for t in cr.spec.traffic] == [("v1", 90), ("v2", 10)]
    assert cr.spec.routing.sticky_by == "user"

    promoted = client.post(
        f"{base}/promote", json={"version": "v2", "reason": "good"}, headers=headers
    ).json()
    assert promoted["traffic"] == [{"version": "v2", "weight": 100}]
    back = client.post(f"{base}/rollback", json={"reason": "p95 regressed"}, headers=headers).json()
    assert back["traffic"] == [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}]
    back_again = client.post(f"{base}/rollback", headers=headers).json()
    assert back_again["traffic"] == [{"version": "v1", "weight": 100}]
    nothing_left = client.post(f"{base}/rollback", headers=headers)
    assert nothing_left.status_code == 409
    cr = validate_inference_model(store.find("InferenceModel", model, tenant))
    assert [(t.version, t.weight) for t in cr.spec.traffic] == [("v1", 100)]

    history = client.get(f"{base}/rollouts", headers=headers).json()
    actions = [(r["action"], r["state"]) for r in reversed(history["data"])]
    assert actions == [
        ("traffic", "applied"),
        ("traffic", "rolled_back"),
        ("promote", "rolled_back"),
        ("rollback", "applied"),
        ("rollback", "applied"),
    ]
    newest = history["data"][0]
    assert newest["from_weights"] == [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}]
    assert newest["to_weights"] == [{"version": "v1", "weight": 100}]
    assert history["data"][1]["reason"] == "p95 regressed" and newest["actor"].startswith(tenant)


def test_stale_expected_version_gets_409_and_changes_nothing(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key()
    model = factory.served_model(tenant, headers)
    base = f"{API}/tenants/{tenant}/models/{model}"
    seen = client.get(base, headers=headers).json()["version"]
    body = {"traffic": [{"version": "v2", "weight": 100}], "expected_version": seen}
    assert client.post(f"{base}/traffic", json=body, headers=headers).status_code == 200
    stale = client.post(
        f"{base}/traffic", json={**body, "traffic": [{"version": "v1", "weight": 100}]}, headers=headers
    )
    assert stale.status_code == 409 and stale.json()["error"]["param"] == "expected_version"
    assert client.get(base, headers=headers).json()["traffic"] == [{"version": "v2", "weight": 100}]
    patch = client.patch(base, json={"description": "x", "expected_version": seen}, headers=headers)
    assert patch.status_code == 409


def test_validation_errors_name_the_field(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key()
    model = factory.served_model(tenant, headers)
    base = f"{API}/tenants/{tenant}/models/{model}"
    cases = [
        (f"{base}/traffic", {"traffic": [{"version": "v1", "weight": 60}]}, "traffic", "sum to 100"),
        (f"{base}/traffic", {"traffic": [{"version": "v1", "weight": 101}]}, "traffic.0.weight", "100"),
        (f"{base}/traffic", {"traffic": [{"version": "v9", "weight": 100}]}, "traffic.0.version", "v9"),
        (f"{base}/promote", {"version": "v9"}, "version", "v9"),
        (f"{API}/tenants/{tenant}/models", {"name": "Bad_Name"}, "name", "pattern"),
        (
            f"{API}/tenants/{tenant}/models",
            {"name": "m", "hardware": {"accelerator": "tpu"}},
            "hardware.accelerator",
            "unknown accelerator",
        ),
        (f"{base}/versions", {"version": "v3", "source": {"uri": "ftp://x"}}, "source.uri", "pattern"),
    ]
    for url, body, field, words in cases:
        answer = client.post(url, json=body, headers=headers)
        assert answer.status_code == 422, (body, answer.text)
        error = answer.json()["error"]
        assert error["param"] == field and words in error["message"], error
        assert error["message"].startswith(field)
    bad_page = client.get(f"{API}/tenants/{tenant}/models", params={"limit": 0}, headers=headers)
    assert bad_page.status_code == 422 and bad_page.json()["error"]["param"] == "limit"


def test_every_mutating_call_is_audited(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key()
    model = factory.served_model(tenant, headers)
    client.post(f"{API}/tenants/{tenant}/models/{model}/promote", json={"version": "v2"}, headers=headers)
    client.post(f"{API}/tenants/{tenant}/models/{model}/rollback", headers=headers)
    client.delete(
        f"{API}/tenants/{tenant}/models/{model}/versions/v2", headers=headers
    )  # 409: v2 has traffic
    client.patch(f"{API}/tenants/{tenant}/models/{model}", json={"description": "d"}, headers=headers)
    client.delete(f"{API}/tenants/{tenant}/models/{model}", headers=headers)
    events = client.get(f"{API}/audit", headers=headers).json()["data"]
    actions = [e["action"] for e in reversed(events)]
    assert actions == [
        "tenant.create",
        "key.create",
        "model.create",
        "version.create",
        "version.create",
        "model.traffic",
        "model.promote",
        "model.rollback",
        "model.update",
        "model.delete",
    ]
    assert all(e["tenant"] == tenant for e in events)
    assert events[0]["target"] == f"{tenant}/{model}" and events[-1]["actor"] == "admin"
    admin_view = client.get(
        f"{API}/audit", params={"tenant": tenant, "action": "model.traffic"}, headers=ADMIN
    )
    assert admin_view.json()["count"] == 1
    # The refused delete is audited for the admin only (tenant None), naming the caller and the attempt.
    refused = client.get(f"{API}/audit", params={"action": "refused"}, headers=ADMIN).json()["data"]
    mine = [e for e in refused if e["detail"]["caller_tenant"] == tenant]
    assert [(e["target"], e["detail"]["status"]) for e in mine] == [
        (f"DELETE {API}/tenants/{tenant}/models/{model}/versions/v2", 409)
    ]
    assert mine[0]["tenant"] is None and mine[0]["actor"] == events[0]["actor"]


def test_reads_merge_live_status_and_keep_artifacts(client: TestClient, factory: Factory, store: MemoryStore):
    tenant, headers = factory.tenant_with_key()
    model = factory.served_model(tenant, headers)
    im = store.find("InferenceModel", model, tenant)
    im["status"] = {"endpoint": f"http://{model}.{tenant}.svc", "traffic": "v1=90,v2=10"}
    mv = store.find("ModelVersion", f"{model}-v1", tenant)
    artifact = {
        "accelerator": "cpu",
        "format": "onnx",
        "dtype": "int8",
        "uri": "pvc://a/v1",
        "sizeBytes": 123,
        "sha256": "b" * 64,
        "validation": {"top1_agreement": 1.0},
    }
    mv["status"] = {"phase": "Ready", "artifacts": [artifact]}

    got = client.get(f"{API}/tenants/{tenant}/models/{model}", headers=headers).json()
    assert got["status"]["endpoint"] == f"http://{model}.{tenant}.svc"
    listed = client.get(f"{API}/tenants/{tenant}/models", headers=headers).json()["data"]
    assert listed[0]["status"]["traffic"] == "v1=90,v2=10"
    version = client.get(f"{API}/tenants/{tenant}/models/{model}/versions/v1", headers=headers).json()
    assert version["phase"] == "Ready" and version["weight"] == 90
    assert version["artifacts"][0]["size_bytes"] == 123

    store.objects.clear()  # the cluster forgets; the registry remembers the artifacts
    version = client.get(f"{API}/tenants/{tenant}/models/{model}/versions/v1", headers=headers).json()
    assert version["phase"] is None
    assert [(a["format"], a["dtype"], a["sha256"]) for a in version["artifacts"]] == [
        ("onnx", "int8", "b" * 64)
    ]


def test_cluster_failure_rolls_the_registry_back(client: TestClient, factory: Factory, store: MemoryStore):
    from modelfleet.controlplane.errors import ClusterUnavailable

    tenant, headers = factory.tenant_with_key()
    model = factory.served_model(tenant, headers)
    store.fail_with = ClusterUnavailable("Kubernetes refused to apply InferenceModel: 500 boom")
    answer = factory.client.post(
        f"{API}/tenants/{tenant}/models/{model}/promote", json={"version": "v2"}, headers=headers
    )
    assert answer.status_code == 502 and "boom" in answer.json()["error"]["message"]
    store.fail_with = None
    model_now = client.get(f"{API}/tenants/{tenant}/models/{model}", headers=headers).json()
    assert model_now["traffic"] == [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}]
    assert client.get(f"{API}/tenants/{tenant}/models/{model}/rollouts", headers=headers).json()["count"] == 1


def test_metrics_count_requests_by_route(client: TestClient, factory: Factory):
    tenant, headers = factory.tenant_with_key()
    client.get(f"{API}/tenants/{tenant}/models", headers=headers)
    text = client.get("/metrics").text
    assert 'route="/api/v1/tenants/{tenant_name}/models"' in text
    assert "modelfleet_controlplane_db_query_duration_seconds_count" in text


def test_requests_and_sql_statements_are_traced(database_url: str, tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(make_settings(database_url), cluster=NoCluster(), tracer_provider=provider)
    with TestClient(app) as client:
        tenant, headers = Factory(client).tenant_with_key()
        exporter.clear()
        client.get(f"{API}/tenants/{tenant}/models", headers=headers)
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert server.name == "GET /api/v1/tenants/{tenant_name}/models"
    queries = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert queries and all(s.attributes["db.operation.name"] == "SELECT" for s in queries)
    by_id = {s.context.span_id: s for s in spans}
    for query in queries:  # each SQL span sits under the request's server span
        ancestor = query
        while ancestor.parent is not None and ancestor.parent.span_id in by_id:
            ancestor = by_id[ancestor.parent.span_id]
        assert ancestor is server, query.name
