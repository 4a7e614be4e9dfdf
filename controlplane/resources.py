"""The Kubernetes objects the control plane owns in a tenant's namespace, as plain dicts.

Pure functions of registry rows: the cluster client only applies what these return. The two custom
resources are built through `modelfleet.operator.api`, so a body the operator would refuse never leaves.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from modelfleet.controlplane.models import Model, ModelVersion, Tenant
from modelfleet.converters.formats import HARDWARE
from modelfleet.operator import api

FIELD_MANAGER = "modelfleet-controlplane"
# The operator mounts this Secret into the data-plane pods and points MODELFLEET_API_KEY_FILE at the file.
KEYS_SECRET = "modelfleet-api-keys"
KEYS_SECRET_FILE = "keys"
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


def key_entry(tenant: Tenant, prefix: str, digest: str) -> dict[str, Any]:
    """One line of the data plane's key file: the token's SHA-256, a label, and the tenant's rate limit."""
    return {"sha256": digest, "name": prefix, "tokens_per_minute": tenant.token_rate_limit}


def key_entries(secret: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The entries of an existing key Secret (none if it is missing or unreadable)."""
    encoded = ((secret or {}).get("data") or {}).get(KEYS_SECRET_FILE)
    if not encoded:
        return []
    try:
        entries = json.loads(base64.b64decode(encoded))
    except ValueError:
        return []
    return [e for e in entries if isinstance(e, dict) and "sha256" in e] if isinstance(entries, list) else []


def reconcile_key_entries(
    tenant: Tenant, entries: list[dict[str, Any]], usable_prefixes: list[str], new: tuple[str, str] | None
) -> list[dict[str, Any]]:
    """Keep the entries of keys that still authenticate (revoked and expired ones go), at the tenant's
    current limit, plus the new key's entry."""
    usable = set(usable_prefixes)
    kept = [key_entry(tenant, e["name"], e["sha256"]) for e in entries if e.get("name") in usable]
    if new is not None:
        kept = [e for e in kept if e["name"] != new[0]] + [key_entry(tenant, *new)]
    return sorted(kept, key=lambda e: e["name"])


def key_secret(tenant: Tenant, entries: list[dict[str, Any]], resource_version: str | None) -> dict[str, Any]:
    """The Secret the tenant's data-plane pods mount as their key file (JSON, digests only).

    With the resourceVersion that was read, the API server refuses the write if the Secret changed
    since, so two concurrent key changes cannot drop each other's entry.
    """
    meta = _meta(KEYS_SECRET, tenant)
    if resource_version:
        meta["resourceVersion"] = resource_version
    document = json.dumps(entries, indent=1, sort_keys=True).encode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {KEYS_SECRET_FILE: base64.b64encode(document).decode()},
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
        quantize_lm_head=bool(version.quantize_lm_head),  # None on a row not yet flushed: the default
        targets=[api.Target(**target) for target in version.targets],
    )
    meta = _meta(version_object_name(model.name, version.name), tenant)
    meta["labels"]["modelfleet.dev/model"] = model.name
    body = api.ModelVersion(metadata=meta, spec=spec)
    return body.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
