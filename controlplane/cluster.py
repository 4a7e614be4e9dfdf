"""The cluster client: the control plane's writes as Kubernetes objects, and live status for reads.

`Cluster` is the interface the routes use. `KubernetesCluster` turns registry rows into objects
(resources.py) and hands them to an `ObjectStore`: the Kubernetes API through the operator's client with
server-side apply (one Kubernetes client for the two components), or anything else that stores dicts
(tests). `NoCluster` runs the registry alone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from modelfleet.controlplane import resources
from modelfleet.controlplane.core.config import Settings
from modelfleet.controlplane.errors import ClusterConflict, ClusterUnavailable
from modelfleet.controlplane.models import Model, ModelVersion, Tenant
from modelfleet.operator.api import API_VERSION

log = logging.getLogger(__name__)
KEY_SECRET_RETRIES = 5


class Cluster(Protocol):
    name: str

    def describe(self) -> str: ...
    def apply_tenant(self, tenant: Tenant, usable_keys: list[str]) -> None: ...
    def delete_tenant(self, tenant: Tenant) -> None: ...
    def apply_keys(
        self, tenant: Tenant, usable_keys: list[str], new_key: tuple[str, str] | None = None
    ) -> None:
        """The tenant's key Secret lists exactly the usable key prefixes; `new_key` is (prefix, sha256)."""

    def apply_model(self, tenant: Tenant, model: Model) -> None: ...
    def delete_model(self, tenant: Tenant, model: Model) -> None: ...
    def apply_version(self, tenant: Tenant, model: Model, version: ModelVersion) -> None: ...
    def delete_version(self, tenant: Tenant, model: Model, version: ModelVersion) -> None: ...
    def model_status(self, tenant: Tenant, model_name: str) -> dict[str, Any] | None: ...
    def model_statuses(self, tenant: Tenant) -> dict[str, dict[str, Any]]: ...
    def version_status(self, tenant: Tenant, model_name: str, version_name: str) -> dict[str, Any] | None: ...
    def version_statuses(self, tenant: Tenant, model_name: str) -> dict[str, dict[str, Any]]: ...


class NoCluster:
    """Registry only: writes stay in the database, reads carry no live status."""

    name = "none"

    def describe(self) -> str:
        return (
            "no cluster configured: running as a registry only "
            "(set KUBECONFIG or MODELFLEET_CONTROLPLANE_CLUSTER=kubernetes to write CRs)"
        )

    def apply_tenant(self, tenant: Tenant, usable_keys: list[str]) -> None:
        pass

    def delete_tenant(self, tenant: Tenant) -> None:
        pass

    def apply_keys(
        self, tenant: Tenant, usable_keys: list[str], new_key: tuple[str, str] | None = None
    ) -> None:
        pass

    def apply_model(self, tenant: Tenant, model: Model) -> None:
        pass

    def delete_model(self, tenant: Tenant, model: Model) -> None:
        pass

    def apply_version(self, tenant: Tenant, model: Model, version: ModelVersion) -> None:
        pass

    def delete_version(self, tenant: Tenant, model: Model, version: ModelVersion) -> None:
        pass

    def model_status(self, tenant: Tenant, model_name: str) -> dict[str, Any] | None:
        return None

    def model_statuses(self, tenant: Tenant) -> dict[str, dict[str, Any]]:
        return {}

    def version_status(self, tenant: Tenant, model_name: str, version_name: str) -> dict[str, Any] | None:
        return None

    def version_statuses(self, tenant: Tenant, model_name: str) -> dict[str, dict[str, Any]]:
        return {}


class ObjectStore(Protocol):
    """Where objects go: apply (create or update, idempotent), delete, get and list by kind."""

    def apply(self, body: dict[str, Any]) -> None: ...
    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> None: ...
    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None: ...
    def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]: ...


class KubernetesCluster:
    name = "kubernetes"

    def __init__(self, store: ObjectStore, *, where: str = "") -> None:
        self.store = store
        self.where = where

    def describe(self) -> str:
        return f"writing InferenceModel and ModelVersion objects to Kubernetes {self.where}".rstrip()

    def _apply(self, body: dict[str, Any] | None) -> None:
        if body is not None:
            self.store.apply(body)

    def apply_tenant(self, tenant: Tenant, usable_keys: list[str]) -> None:
        self._apply(resources.namespace(tenant))
        self._apply(resources.resource_quota(tenant))
        self.apply_keys(tenant, usable_keys)

    def delete_tenant(self, tenant: Tenant) -> None:
        # The namespace takes everything of the tenant with it: pods, CRs, the Secret, the quota.
        self.store.delete("v1", "Namespace", tenant.namespace, None)

    def apply_keys(
        self, tenant: Tenant, usable_keys: list[str], new_key: tuple[str, str] | None = None
    ) -> None:
        # Read-modify-write: the digests live only in the Secret (the database keeps peppered hashes).
        for _ in range(KEY_SECRET_RETRIES):
            current = self.store.get("v1", "Secret", resources.KEYS_SECRET, tenant.namespace)
            entries = resources.reconcile_key_entries(
                tenant, resources.key_entries(current), usable_keys, new_key
            )
            version = (current or {}).get("metadata", {}).get("resourceVersion")
            try:
                self.store.apply(resources.key_secret(tenant, entries, version))
                return
            except ClusterConflict:
                continue
        raise ClusterConflict(f"the API key Secret of tenant {tenant.name!r} kept changing; retry")

    def apply_model(self, tenant: Tenant, model: Model) -> None:
        self._apply(resources.inference_model(tenant, model))

    def delete_model(self, tenant: Tenant, model: Model) -> None:
        self.store.delete(API_VERSION, "InferenceModel", model.name, tenant.namespace)
        for obj in self.store.list(
            API_VERSION, "ModelVersion", tenant.namespace, {"modelfleet.dev/model": model.name}
        ):
            self.store.delete(API_VERSION, "ModelVersion", obj["metadata"]["name"], tenant.namespace)

    def apply_version(self, tenant: Tenant, model: Model, version: ModelVersion) -> None:
        self._apply(resources.model_version(tenant, model, version))

    def delete_version(self, tenant: Tenant, model: Model, version: ModelVersion) -> None:
        name = resources.version_object_name(model.name, version.name)
        self.store.delete(API_VERSION, "ModelVersion", name, tenant.namespace)

    # Reads degrade to the registry alone: a status we cannot fetch is shown as unknown, not as an error.

    def model_status(self, tenant: Tenant, model_name: str) -> dict[str, Any] | None:
        obj = self._quiet_get("InferenceModel", model_name, tenant.namespace)
        return (obj or {}).get("status")

    def model_statuses(self, tenant: Tenant) -> dict[str, dict[str, Any]]:
        return {
            obj["metadata"]["name"]: obj.get("status") or {}
            for obj in self._quiet_list("InferenceModel", tenant, {})
        }

    def version_status(self, tenant: Tenant, model_name: str, version_name: str) -> dict[str, Any] | None:
        obj = self._quiet_get(
            "ModelVersion", resources.version_object_name(model_name, version_name), tenant.namespace
        )
        return (obj or {}).get("status")

    def version_statuses(self, tenant: Tenant, model_name: str) -> dict[str, dict[str, Any]]:
        found = self._quiet_list("ModelVersion", tenant, {"modelfleet.dev/model": model_name})
        return {obj["spec"]["version"]: obj.get("status") or {} for obj in found}

    def _quiet_get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return self.store.get(API_VERSION, kind, name, namespace)
        except ClusterUnavailable as exc:
            log.warning("live status of %s %s/%s unavailable: %s", kind, namespace, name, exc)
            return None

    def _quiet_list(self, kind: str, tenant: Tenant, labels: dict[str, str]) -> list[dict[str, Any]]:
        try:
            return self.store.list(API_VERSION, kind, tenant.namespace, labels)
        except ClusterUnavailable as exc:
            log.warning("live status of %s in %s unavailable: %s", kind, tenant.namespace, exc)
            return []


class KubeStore:
    """The Kubernetes API through the operator's client (`operator/kube.py`: one path table, server-side
    apply), under the control plane's own field manager; its errors become the control plane's."""

    def __init__(self, api_client: Any) -> None:
        from modelfleet.operator.kube import Kube

        self.kube = Kube(api_client, field_manager=resources.FIELD_MANAGER)

    def apply(self, body: dict[str, Any]) -> None:
        what = f"apply {body['kind']} {body['metadata']['name']}"
        self._call(lambda: self.kube.apply(body), what, kind=body["kind"])

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> None:
        self._call(lambda: self.kube.delete(api_version, kind, namespace, name), f"delete {kind} {name}")

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
        return self._call(lambda: self.kube.get(api_version, kind, namespace, name), f"get {kind} {name}")

    def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        return self._call(lambda: self.kube.list(api_version, kind, namespace, labels), f"list {kind}")

    @staticmethod
    def _call(action: Any, what: str, *, kind: str = "") -> Any:
        from modelfleet.operator.kube import KubeError

        try:
            return action()
        except KubeError as exc:
            if exc.status == 409:
                raise ClusterConflict(f"Kubernetes refused to {what}: it changed meanwhile") from None
            if exc.status == 0:
                raise ClusterUnavailable(f"Kubernetes unreachable while trying to {what}: {exc}") from None
            if exc.status == 404 and kind in ("InferenceModel", "ModelVersion"):
                raise ClusterUnavailable(
                    f"the cluster does not serve {kind} ({API_VERSION}); "
                    "install the modelfleet CRDs (charts/)"
                ) from None
            raise ClusterUnavailable(f"Kubernetes refused to {what}: {exc}") from None


def in_cluster() -> bool:
    return (
        bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        and Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists()
    )


def kubeconfig_path(settings: Settings) -> str | None:
    path = settings.kubeconfig or os.path.expanduser("~/.kube/config")
    return path if Path(path).exists() else None


def connect(settings: Settings) -> Cluster:
    """The cluster the settings ask for; `auto` uses Kubernetes when it finds credentials."""
    if settings.cluster == "none":
        return NoCluster()
    config_path = kubeconfig_path(settings)
    if settings.cluster == "auto" and not (config_path or in_cluster()):
        return NoCluster()
    import yaml
    from kubernetes import client, config

    if config_path:
        try:
            api_client = config.new_client_from_config(config_file=config_path)
        except (config.ConfigException, yaml.YAMLError, ValueError, TypeError) as error:
            problem = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ClusterUnavailable(
                f"kubeconfig {config_path}: {problem}; fix it or unset KUBECONFIG"
            ) from None
        where = f"(kubeconfig {config_path})"
    elif in_cluster():
        config.load_incluster_config()
        api_client = client.ApiClient()
        where = "(in-cluster service account)"
    else:
        raise ClusterUnavailable(
            "MODELFLEET_CONTROLPLANE_CLUSTER=kubernetes but no kubeconfig or in-cluster credentials found"
        )
    return KubernetesCluster(KubeStore(api_client), where=where)
