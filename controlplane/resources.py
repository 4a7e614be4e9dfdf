"""The Kubernetes objects the control plane owns in a tenant's namespace, as plain dicts.

Pure functions of registry rows: the cluster client only applies what these return. The two custom
resources are built through `modelfleet.operator.api`, so a body the operator would refuse never leaves.
"""

from __future__ import annotations

import json
from typing import Any

from modelfleet.controlplane.core.security import HASH_ALGORITHM
from modelfleet.controlplane.models import ApiKey, Model, ModelVersion, Tenant
from modelfleet.converters.formats import HARDWARE
from modelfleet.operator import api

FIELD_MANAGER = "modelfleet-controlplane"
KEYS_SECRET = "modelfleet-api-keys"
KEYS_SECRET_FILE = "keys.json"
QUOTA_NAME = "modelfleet-quota"
TENANT_LABEL = "modelfleet.dev/tenant"
MANAGED_BY = {"app.kubernetes.io/managed-by": FIELD_MANAGER}
# Device resources that count against a tenant's GPU quota (one quota per vendor resource).
GPU_RESOURCES = sorted({hw.resource_name for hw in HARDWARE.values() if hw.resource_name})


def _meta(name: str, tenant: Tenant, *, namespaced: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {**MANAGED_BY, TENANT_LABEL: tenant.name}}
    if namespaced:
        meta["namespace"] = tenant.namespace
    return meta


def namespace(tenant: Tenant) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": _meta(tenant.namespace, tenant, namespaced=False),
    }


def resource_quota(tenant: Tenant) -> dict[str, Any]:
    hard = {f"requests.{resource}": str(tenant.gpu_quota) for resource in GPU_RESOURCES}
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": _meta(QUOTA_NAME, tenant),
        "spec": {"hard": hard},
    }


def key_secret(tenant: Tenant, keys: list[ApiKey], pepper: bytes) -> dict[str, Any]:
    """The hashes of a tenant's usable keys, for its data-plane pods to check bearer tokens against.

    A pod verifies a token by HMAC-SHA256(pepper, token) == hash for the entry with the token's prefix.
    The pepper here is the tenant's own, derived from the server's; it opens nothing elsewhere.
    """
    document = {
        "algorithm": HASH_ALGORITHM,
        "pepper": pepper.hex(),
        "tokenRateLimit": tenant.token_rate_limit,
        "keys": [
            {
                "prefix": key.prefix,
                "hash": key.key_hash,
                "expiresAt": key.expires_at.isoformat() if key.expires_at else None,
            }
            for key in keys
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(KEYS_SECRET, tenant),
        "type": "Opaque",
        "stringData": {KEYS_SECRET_FILE: json.dumps(document, indent=1, sort_keys=True)},
    }


def version_object_name(model_name: str, version_name: str) -> str:
    return f"{model_name}-{version_name}"


def inference_model(tenant: Tenant, model: Model) -> dict[str, Any] | None:
    """The InferenceModel CR, or None while the model has no traffic split (the CRD requires one)."""
    if not model.traffic:
        return None
    spec = api.InferenceModelSpec(
        hardware=api.Hardware(accelerator=model.accelerator, count=model.gpu_count),
        replicas=api.Replicas(min=model.min_replicas, max=model.max_replicas),
        traffic=[api.TrafficEntry(version=e["version"], weight=e["weight"]) for e in model.traffic],
        routing=api.Routing(sticky_by=model.sticky_by),
        loading=api.Loading(mode=model.loading),
    )
    body = api.InferenceModel(metadata=_meta(model.name, tenant), spec=spec)
    return body.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})


def model_version(tenant: Tenant, model: Model, version: ModelVersion) -> dict[str, Any]:
    spec = api.ModelVersionSpec(
        model=model.name,
        version=version.name,
        source=api.Source(uri=version.source_uri, format=version.source_format, sha256=version.digest),
        quantization=version.quantization,
        targets=[api.Target(**target) for target in version.targets],
    )
    meta = _meta(version_object_name(model.name, version.name), tenant)
    meta["labels"]["modelfleet.dev/model"] = model.name
    body = api.ModelVersion(metadata=meta, spec=spec)
    return body.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
