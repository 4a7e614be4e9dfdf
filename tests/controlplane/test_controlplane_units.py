"""The pieces without HTTP: settings, key hashing, the Kubernetes objects, migrations, the command."""

from __future__ import annotations

import argparse
import logging
import uuid

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from controlplane_factories import MemoryStore, make_settings
from fastapi.testclient import TestClient
from kubernetes import client as k8s_client
from modelfleet.controlplane import cluster as cluster_module
from modelfleet.controlplane import resources
from modelfleet.controlplane.cli import add_parser
from modelfleet.controlplane.cluster import KubernetesCluster, KubeStore, NoCluster
from modelfleet.controlplane.core import db, security
from modelfleet.controlplane.core.config import DEV_ADMIN_KEY, Settings
from modelfleet.controlplane.errors import ClusterConflict, ClusterUnavailable
from modelfleet.controlplane.main import create_app
from modelfleet.controlplane.models import Base, Model, ModelVersion, Tenant
from modelfleet.controlplane.resources import FIELD_MANAGER
from modelfleet.operator.kube import Kube, KubeError, resource_path
from modelfleet.operator.reconcile.names import FIELD_MANAGER as OPERATOR_MANAGER
from modelfleet.operator.validation import validate_inference_model, validate_model_version
from pydantic import ValidationError
from sqlalchemy import inspect


def test_settings_refuse_default_secrets_outside_development(monkeypatch):
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_ENVIRONMENT", "production")
    with pytest.raises(ValidationError, match="MODELFLEET_CONTROLPLANE_ADMIN_KEY"):
        Settings()
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_ADMIN_KEY", "a" * 32)
    with pytest.raises(ValidationError, match="MODELFLEET_CONTROLPLANE_KEY_PEPPER"):
        Settings()
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_KEY_PEPPER", "p" * 32)
    assert Settings().environment == "production"
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_ENVIRONMENT", "development")
    monkeypatch.delenv("MODELFLEET_CONTROLPLANE_ADMIN_KEY")
    assert Settings().admin_key.get_secret_value() == DEV_ADMIN_KEY


def test_settings_read_database_url_with_or_without_prefix(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p@db:5432/fleet")
    assert Settings().database_url == "postgresql+psycopg://u:p@db:5432/fleet"
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_DATABASE_URL", "sqlite:///x.db")
    assert Settings().database_url == "sqlite:///x.db"


def test_keys_are_random_prefixed_and_hashed_with_the_pepper():
    one, two = security.new_key("pepper-1"), security.new_key("pepper-1")
    assert one.token != two.token and one.prefix != two.prefix
    assert security.parse_prefix(one.token) == one.prefix and len(one.prefix) == security.PREFIX_LENGTH
    assert security.key_matches(one.token, one.key_hash, "pepper-1")
    assert not security.key_matches(one.token, one.key_hash, "pepper-2")
    assert not security.key_matches(two.token, one.key_hash, "pepper-1")
    assert one.token not in repr(one)
    for malformed in ("", "mf_", "mf_short_x", "xx_abcdefgh_secret", "mf_abcdefgh_"):
        assert security.parse_prefix(malformed) is None


def _rows() -> tuple[Tenant, Model, ModelVersion]:
    tenant = Tenant(name="acme", namespace="acme-ns", gpu_quota=4, token_rate_limit=1000, allowed_models=[])
    model = Model(
        name="chat",
        accelerator="nvidia-h100",
        gpu_count=2,
        min_replicas=1,
        max_replicas=3,
        sticky_by="user",
        loading="eager",
        traffic=[{"version": "v1", "weight": 80}, {"version": "v2", "weight": 20}],
    )
    version = ModelVersion(
        name="v2",
        source_uri="s3://bucket/chat/v2",
        source_format="hf-safetensors",
        digest="c" * 64,
        quantization="fp8",
        quantize_lm_head=True,
        targets=[{"accelerator": "nvidia-h100", "format": "torch", "dtype": "fp8"}],
    )
    return tenant, model, version


def test_custom_resources_validate_against_the_operator_schema():
    tenant, model, version = _rows()
    im = validate_inference_model(resources.inference_model(tenant, model))
    assert im.metadata["namespace"] == "acme-ns" and im.spec.hardware.count == 2
    assert im.spec.loading.mode == "eager" and im.spec.replicas.max == 3
    mv = validate_model_version(resources.model_version(tenant, model, version))
    assert mv.metadata["name"] == "chat-v2" and mv.metadata["labels"]["modelfleet.dev/model"] == "chat"
    assert mv.spec.source.sha256 == "c" * 64 and mv.spec.targets[0].dtype == "fp8"
    assert mv.spec.quantize_lm_head
    model.traffic = []
    assert resources.inference_model(tenant, model) is None  # the CRD requires a split


def test_quota_covers_every_gpu_vendor():
    tenant, _, _ = _rows()
    hard = resources.resource_quota(tenant)["spec"]["hard"]
    assert hard["requests.nvidia.com/gpu"] == "4" and hard["requests.amd.com/gpu"] == "4"
    assert all(value == "4" for value in hard.values())


def test_key_entries_keep_usable_keys_only_at_the_current_limit():
    tenant, _, _ = _rows()
    entries = [
        resources.key_entry(tenant, "aaaaaaaa", "1" * 64),
        resources.key_entry(tenant, "bbbbbbbb", "2" * 64),
    ]
    tenant.token_rate_limit = 50
    kept = resources.reconcile_key_entries(tenant, entries, ["bbbbbbbb", "cccccccc"], ("cccccccc", "3" * 64))
    assert kept == [
        {"sha256": "2" * 64, "name": "bbbbbbbb", "tokens_per_minute": 50},
        {"sha256": "3" * 64, "name": "cccccccc", "tokens_per_minute": 50},
    ]
    secret = resources.key_secret(tenant, kept, resource_version="7")
    assert resources.key_entries(secret) == kept and secret["metadata"]["resourceVersion"] == "7"
    assert resources.key_entries({"data": {"keys": "not base64 json"}}) == []


def test_cluster_writes_and_reads_through_the_store():
    tenant, model, version = _rows()
    store = MemoryStore()
    cluster = KubernetesCluster(store)
    cluster.apply_tenant(tenant, usable_keys=[])
    cluster.apply_model(tenant, model)
    cluster.apply_version(tenant, model, version)
    store.find("ModelVersion", "chat-v2", "acme-ns")["status"] = {"phase": "Converting"}
    assert cluster.version_statuses(tenant, "chat") == {"v2": {"phase": "Converting"}}
    assert cluster.version_status(tenant, "chat", "v2") == {"phase": "Converting"}
    cluster.apply_version(tenant, model, version)  # a re-apply keeps the operator's status
    assert cluster.version_status(tenant, "chat", "v2") == {"phase": "Converting"}
    cluster.delete_model(tenant, model)
    assert store.find("InferenceModel", "chat", "acme-ns") is None
    assert store.find("ModelVersion", "chat-v2", "acme-ns") is None
    cluster.delete_tenant(tenant)
    assert store.objects == {}


def _migrated_from_empty(url: str) -> list:
    engine = db.make_engine(make_settings(url))
    db.run_migrations(engine)
    with engine.connect() as connection:
        diffs = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
        )
        tables = set(inspect(connection).get_table_names())
    engine.dispose()
    assert {
        "tenants",
        "api_keys",
        "models",
        "model_versions",
        "artifacts",
        "rollouts",
        "audit_events",
    } <= tables
    return diffs


def test_migrations_build_the_models_schema_on_sqlite(tmp_path):
    assert _migrated_from_empty(f"sqlite:///{tmp_path}/fresh.db") == []


def test_migrations_downgrade_to_nothing_and_back(tmp_path):
    engine = db.make_engine(make_settings(f"sqlite:///{tmp_path}/roundtrip.db"))
    db.run_migrations(engine)
    config = db.alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    db.run_migrations(engine)
    assert set(Base.metadata.tables) <= set(inspect(engine).get_table_names())
    engine.dispose()


@pytest.mark.postgres
def test_migrations_build_the_models_schema_on_postgresql(postgres_server):
    assert _migrated_from_empty(postgres_server.create_database(f"fresh_{uuid.uuid4().hex[:8]}")) == []


def test_registry_only_mode_says_so_at_start_up(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="modelfleet.controlplane")
    app = create_app(make_settings(f"sqlite:///{tmp_path}/cp.db"), cluster=NoCluster())
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok", "cluster": "none"}
    assert any("running as a registry only" in record.getMessage() for record in caplog.records)


def run_command(*argv: str) -> int:
    """`modelfleet controlplane ...` in this process."""
    parser = argparse.ArgumentParser(prog="modelfleet")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["controlplane", *argv])
    return args.func(args)


def test_command_refuses_default_secrets_in_production_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_ENVIRONMENT", "production")
    assert run_command("--migrate-only") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: MODELFLEET_CONTROLPLANE_ADMIN_KEY: set a random secret of at least 24 characters "
        "when MODELFLEET_CONTROLPLANE_ENVIRONMENT=production"
    ]


def test_command_migrates_a_sqlite_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path}/cli.db")
    monkeypatch.setenv("MODELFLEET_CONTROLPLANE_CLUSTER", "none")
    assert run_command("--migrate-only", "--log-level", "warning") == 0
    assert "schema at head" in capsys.readouterr().err
    assert (tmp_path / "cli.db").stat().st_size > 0


class FakeKube:
    """Stands in for the operator's Kube: records calls, or fails with a KubeError of one status."""

    def __init__(self, status: int | None = None) -> None:
        self.status = status
        self.calls: list[tuple] = []

    def _maybe_fail(self) -> None:
        if self.status is not None:
            raise KubeError(self.status, f"HTTP {self.status}")

    def apply(self, body):
        self.calls.append(("apply", body))
        self._maybe_fail()
        return body

    def get(self, api_version, kind, namespace, name):
        self.calls.append(("get", api_version, kind, namespace, name))
        self._maybe_fail()
        return {"kind": kind, "name": name, "namespace": namespace}

    def delete(self, api_version, kind, namespace, name):
        self.calls.append(("delete", api_version, kind, namespace, name))
        self._maybe_fail()
        return True


def _store(status: int | None = None) -> KubeStore:
    store = KubeStore(api_client=k8s_client.ApiClient())
    store.kube = FakeKube(status)
    return store


def test_the_cluster_client_is_the_operators_with_our_field_manager():
    store = KubeStore(api_client=k8s_client.ApiClient())
    assert isinstance(store.kube, Kube) and store.kube.field_manager == FIELD_MANAGER != OPERATOR_MANAGER


def test_kube_store_passes_calls_on_in_the_operators_argument_order():
    store = _store()
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "ns"}}
    store.apply(body)
    assert store.get("v1", "Secret", "s", "ns") == {"kind": "Secret", "name": "s", "namespace": "ns"}
    store.delete("v1", "Namespace", "team", None)
    assert store.kube.calls == [
        ("apply", body),
        ("get", "v1", "Secret", "ns", "s"),
        ("delete", "v1", "Namespace", None, "team"),
    ]


def test_kube_store_maps_api_errors():
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "ns"}}
    with pytest.raises(ClusterConflict):
        _store(409).apply(body)
    with pytest.raises(ClusterUnavailable, match="HTTP 403"):
        _store(403).apply(body)
    with pytest.raises(ClusterUnavailable, match="unreachable"):
        _store(0).get("v1", "Secret", "s", "ns")
    crd_missing = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "m"},
    }
    with pytest.raises(ClusterUnavailable, match="install the modelfleet CRDs"):
        _store(404).apply(crd_missing)


def test_cluster_scoped_kinds_have_no_namespace_in_their_path():
    assert resource_path("v1", "Namespace", None, "team") == "/api/v1/namespaces/team"
    assert resource_path("v1", "Secret", "team", "k") == "/api/v1/namespaces/team/secrets/k"


KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_connect_picks_the_cluster_from_the_settings(tmp_path):
    assert isinstance(cluster_module.connect(make_settings("sqlite://", cluster="none")), NoCluster)
    missing = str(tmp_path / "absent")
    assert isinstance(
        cluster_module.connect(make_settings("sqlite://", cluster="auto", kubeconfig=missing)), NoCluster
    )
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    cluster = cluster_module.connect(make_settings("sqlite://", cluster="auto", kubeconfig=str(path)))
    assert isinstance(cluster, KubernetesCluster) and str(path) in cluster.describe()
    # Nothing listens there: the first write fails as a cluster error, reads degrade to no status.
    tenant, model, _ = _rows()
    with pytest.raises(ClusterUnavailable, match="unreachable"):
        cluster.apply_model(tenant, model)
    path.write_text("clusters: [")
    with pytest.raises(ClusterUnavailable, match="kubeconfig"):
        cluster_module.connect(make_settings("sqlite://", cluster="kubernetes", kubeconfig=str(path)))


def test_the_crds_apply_through_the_one_client():
    """The end-to-end tests install crds/ through the control plane's store before anything else."""
    assert (
        resource_path("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, "x.modelfleet.dev")
        == "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/x.modelfleet.dev"
    )
