"""Everything an InferenceModel should own, as one plan: objects to apply and objects to remove."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelfleet.operator.api import InferenceModelSpec
from modelfleet.operator.reconcile import names, serving
from modelfleet.operator.reconcile.traffic import PlannedVersion, VersionView
from modelfleet.operator.settings import OperatorSettings


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    namespace: str
    name: str


@dataclass
class ServingPlan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    remove: list[ObjectRef] = field(default_factory=list)


def duplicate_versions(model_versions: list[dict[str, Any]]) -> dict[str, str]:
    """ModelVersions naming a (model, version) that an older one already provides -> that older one."""
    first: dict[tuple[str, str], str] = {}
    duplicates = {}
    oldest_first = sorted(
        model_versions, key=lambda mv: (mv["metadata"].get("creationTimestamp") or "", mv["metadata"]["name"])
    )
    for mv in oldest_first:
        key = (mv.get("spec", {}).get("model"), mv.get("spec", {}).get("version"))
        if key in first:
            duplicates[mv["metadata"]["name"]] = first[key]
        else:
            first[key] = mv["metadata"]["name"]
    return duplicates


def version_views(model_versions: list[dict[str, Any]], model_name: str) -> dict[str, VersionView]:
    """The model's ModelVersions by spec.version (objects of other models, and duplicates, are ignored)."""
    views = {}
    duplicates = duplicate_versions(model_versions)
    for mv in model_versions:
        spec, status = mv.get("spec", {}), mv.get("status") or {}
        # A version being deleted still counts: its finalizer keeps it until traffic has left it.
        if spec.get("model") != model_name or not spec.get("version") or mv["metadata"]["name"] in duplicates:
            continue
        ready = next((c for c in status.get("conditions", []) if c.get("type") == "Ready"), {})
        views[spec["version"]] = VersionView(
            name=spec["version"],
            resource_name=mv["metadata"]["name"],
            phase=status.get("phase"),
            quantization=spec.get("quantization", "none"),
            artifacts=list(status.get("artifacts", [])),
            message=ready.get("message", ""),
        )
    return views


def serving_plan(
    im: dict[str, Any],
    spec: InferenceModelSpec,
    planned: list[PlannedVersion],
    settings: OperatorSettings,
    draft_artifact: str | None = None,
) -> ServingPlan:
    """`draft_artifact`: the speculative draft model's path (traffic.draft_artifact), if any."""
    model, namespace = im["metadata"]["name"], im["metadata"]["namespace"]
    manifest = serving.render_manifest(model, spec, planned, draft_artifact)
    plan = ServingPlan(
        apply=[
            serving.manifest_configmap(im, manifest),
            serving.deployment(im, spec, settings),
            serving.peers_service(im, settings),
            serving.service(im, settings),
            serving.disruption_budget(im),
        ]
    )
    hpa = serving.autoscaler(im, spec, settings)
    if hpa is not None:
        plan.apply.append(hpa)
    else:  # replicas.min == max: a fixed size, and an HPA left from before would fight it
        plan.remove.append(
            ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", namespace, names.serving_name(model))
        )
    return plan
