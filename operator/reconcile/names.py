"""Deterministic names and labels of everything the operator creates."""

from __future__ import annotations

import hashlib

from modelfleet.converters.formats import Target

FIELD_MANAGER = "modelfleet-operator"
LABEL_MODEL = "modelfleet.dev/model"
LABEL_VERSION = "modelfleet.dev/version"  # the ModelVersion's metadata.name
LABEL_TARGET = "modelfleet.dev/target"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MAX_NAME = 63  # Job names become the `job-name` label of their pods, so 63 like any label value


def bounded_name(*parts: str, limit: int = MAX_NAME) -> str:
    """`parts` joined by '-', or, when longer than `limit`, cut and suffixed with a stable hash."""
    name = "-".join(p for p in parts if p)
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-.')}-{digest}"


def target_slug(target: Target) -> str:
    return f"{target.accelerator}-{target.format}-{target.dtype}"


def artifact_slug(target: Target, quantized_lm_head: bool = False) -> str:
    """The artifact's folder name: the target's slug, marked when lm_head is quantized too, so that two
    versions differing only in spec.quantizeLmHead never share or overwrite one artifact."""
    return target_slug(target) + ("-lm-head" if quantized_lm_head else "")


def conversion_job_name(version_name: str, target: Target) -> str:
    return bounded_name(version_name, "convert", target_slug(target))


def serving_name(model_name: str) -> str:
    """Name of the Deployment, Service, HPA and PDB of an InferenceModel."""
    return bounded_name(model_name)


def peers_service_name(model_name: str) -> str:
    """The headless Service whose DNS name lists the model's ready pods (each counts its peers by it)."""
    return bounded_name(model_name, "peers")


def manifest_configmap_name(model_name: str) -> str:
    return bounded_name(model_name, "manifest")


def selector_labels(model_name: str) -> dict[str, str]:
    return {LABEL_MODEL: model_name, LABEL_COMPONENT: "dataplane"}


def common_labels(model_name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "modelfleet",
        "app.kubernetes.io/instance": model_name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_MODEL: model_name,
    }


def owner_reference(owner: dict) -> dict:
    """Makes `owner` the controller of a child: deleting it deletes the child (garbage collection)."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
