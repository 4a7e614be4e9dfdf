"""Against a real Kubernetes cluster: a tenant and a model made through the API appear as the tenant's
namespace, ResourceQuota, key Secret and the two custom resources. Needs KUBECONFIG; skipped otherwise.

The CRDs are applied from crds/ first (server-side apply, idempotent), so a bare cluster is enough.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from controlplane_factories import ADMIN, Factory, make_settings
from fastapi.testclient import TestClient
from modelfleet.controlplane import cluster as cluster_module
from modelfleet.controlplane.main import create_app

CRDS = Path(__file__).resolve().parents[2] / "crds"

pytestmark = pytest.mark.skipif(
    not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is not set: no Kubernetes cluster to test against"
)


@pytest.fixture
def live(tmp_path) -> Iterator[tuple[TestClient, cluster_module.KubeStore]]:
    settings = make_settings(
        f"sqlite:///{tmp_path}/cp.db", cluster="kubernetes", kubeconfig=os.environ["KUBECONFIG"]
    )
    cluster = cluster_module.connect(settings)
    assert isinstance(cluster, cluster_module.KubernetesCluster)
    for path in sorted(CRDS.glob("*.yaml")):
        cluster.store.apply(yaml.safe_load(path.read_text()))
    with TestClient(create_app(settings, cluster=cluster)) as client:
        yield client, cluster.store


def test_tenant_and_model_become_cluster_objects(live):
    client, store = live
    factory = Factory(client)
    tenant = f"cp-e2e-{uuid.uuid4().hex[:8]}"
    factory.tenant(tenant, gpu_quota=3, token_rate_limit=600)
    try:
        token = factory.key(tenant)["key"]
        model = factory.model(tenant, name="chat", hardware={"accelerator": "cpu"})
        factory.version(tenant, model, "v1")
        factory.version(tenant, model, "v2", parent="v1")
        factory.traffic(tenant, model, {"v1": 80, "v2": 20}, reason="canary")

        assert (
            store.get("v1", "Namespace", tenant, None)["metadata"]["labels"]["modelfleet.dev/tenant"]
            == tenant
        )
        quota = store.get("v1", "ResourceQuota", "modelfleet-quota", tenant)
        assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == "3"
        secret = store.get("v1", "Secret", "modelfleet-api-keys", tenant)
        entries = json.loads(base64.b64decode(secret["data"]["keys"]))
        assert [e["sha256"] for e in entries] == [hashlib.sha256(token.encode()).hexdigest()]
        im = store.get("modelfleet.dev/v1alpha1", "InferenceModel", "chat", tenant)
        assert im["spec"]["traffic"] == [{"version": "v1", "weight": 80}, {"version": "v2", "weight": 20}]
        for version in ("v1", "v2"):
            mv = store.get("modelfleet.dev/v1alpha1", "ModelVersion", f"chat-{version}", tenant)
            assert mv["spec"]["version"] == version

        # A read merges whatever status the operator has written by now (none is required here).
        got = client.get(f"/api/v1/tenants/{tenant}/models/chat", headers=ADMIN).json()
        assert got["status"] == im.get("status")
    finally:
        client.delete(f"/api/v1/tenants/{tenant}", headers=ADMIN)
    namespace = store.get("v1", "Namespace", tenant, None)
    assert namespace is None or namespace["metadata"].get("deletionTimestamp")
