"""The traffic split actually served: only versions with a Ready artifact for the hardware get weight.

A version that cannot be served (missing, still converting, failed, or converted for other hardware)
gets weight 0, and its share goes to the servable versions in proportion to their weights, so the
served weights still sum to 100. When nothing is servable, all weights are 0 and the model is not Ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelfleet.converters.formats import hardware
from modelfleet.operator.api import InferenceModelSpec
from modelfleet.operator.settings import OperatorSettings


@dataclass(frozen=True)
class VersionView:
    """What the model's reconcile knows of one ModelVersion."""

    name: str  # spec.version
    resource_name: str  # metadata.name
    phase: str | None
    quantization: str = "none"
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""


@dataclass(frozen=True)
class PlannedVersion:
    name: str
    desired_weight: int
    weight: int  # served
    phase: str | None
    artifact_path: str | None
    reason: str  # Servable, VersionNotFound, VersionNotReady, NoArtifactForHardware, ArtifactNotLocal
    message: str


def choose_artifact(view: VersionView, accelerator: str, *, tensorrt: bool) -> dict[str, Any] | None:
    """The artifact to serve on `accelerator`: the quantized one when asked for, else the preferred format.
    `tensorrt`: whether the data-plane image can load TensorRT engines (an artifact built before the
    setting was turned off must not be chosen over one the pods can load)."""
    hw = hardware(accelerator)
    usable = [
        a
        for a in view.artifacts
        if a.get("accelerator") == accelerator
        and hw.supports(a.get("format", ""), a.get("dtype", ""))
        and (tensorrt or a.get("format") != "tensorrt")
    ]
    if not usable:
        return None

    def rank(artifact: dict[str, Any]) -> tuple[int, int]:
        wanted_dtype = 0 if view.quantization != "none" and artifact["dtype"] == view.quantization else 1
        return wanted_dtype, hw.formats.index(artifact["format"])

    return min(usable, key=rank)


def local_path(uri: str, settings: OperatorSettings) -> str | None:
    """Where the data-plane pod finds an artifact (the model store is mounted at the same path)."""
    store = settings.model_store_path.rstrip("/")
    if uri.startswith("file://"):
        return "/" + uri.removeprefix("file://").lstrip("/")
    if uri.startswith(f"pvc://{settings.model_store_claim}/"):
        return f"{store}/{uri.removeprefix(f'pvc://{settings.model_store_claim}/')}"
    if uri.startswith("/"):
        return uri
    return None


def draft_artifact(
    spec: InferenceModelSpec, versions: dict[str, VersionView], settings: OperatorSettings
) -> str | None:
    """Where the pods find the draft model of spec.engine.speculative (proposer draft): the torch
    artifact of the draftVersion on this hardware, on the model store. None while there is none (the
    pods then decode without speculation)."""
    speculative = spec.engine.speculative
    view = versions.get(speculative.draft_version or "")
    if speculative.proposer != "draft" or view is None:
        return None
    artifact = choose_artifact(view, spec.hardware.accelerator, tensorrt=False)
    if artifact is None or artifact.get("format") != "torch":
        return None
    return local_path(artifact["uri"], settings)


def plan_traffic(
    spec: InferenceModelSpec, versions: dict[str, VersionView], settings: OperatorSettings
) -> list[PlannedVersion]:
    """One entry per traffic entry of `spec`, in order, with the weight actually served."""
    accelerator = spec.hardware.accelerator
    servable: dict[str, str] = {}
    notes: dict[str, tuple[str, str]] = {}
    for entry in spec.traffic:
        view = versions.get(entry.version)
        if view is None:
            notes[entry.version] = (
                "VersionNotFound",
                f"no ModelVersion with spec.model and spec.version {entry.version!r}; create it",
            )
            continue
        artifact = choose_artifact(view, accelerator, tensorrt=settings.dataplane_tensorrt)
        if artifact is None and view.phase != "Ready":
            why = f": {view.message}" if view.message else ""
            notes[entry.version] = ("VersionNotReady", f"version is {view.phase or 'Pending'}{why}")
        elif artifact is None:
            notes[entry.version] = (
                "NoArtifactForHardware",
                f"no artifact for {accelerator}; list it in the ModelVersion's spec.targets",
            )
        elif (path := local_path(artifact["uri"], settings)) is None:
            notes[entry.version] = (
                "ArtifactNotLocal",
                f"artifact {artifact['uri']} is not on the model store",
            )
        else:
            servable[entry.version] = path
            notes[entry.version] = ("Servable", f"serving {artifact['format']} {artifact['dtype']}")
    desired = {e.version: e.weight for e in spec.traffic if e.version in servable}
    served = redistribute(desired)
    return [
        PlannedVersion(
            name=e.version,
            desired_weight=e.weight,
            weight=served.get(e.version, 0),
            phase=versions[e.version].phase if e.version in versions else None,
            artifact_path=servable.get(e.version),
            reason=notes[e.version][0],
            message=notes[e.version][1],
        )
        for e in spec.traffic
    ]


def redistribute(weights: dict[str, int], target: int = 100) -> dict[str, int]:
    """Scale weights to sum to `target` (largest remainder, ties by order); all 0 when they sum to 0."""
    total = sum(weights.values())
    if total == 0:
        return dict.fromkeys(weights, 0)
    exact = {name: w * target / total for name, w in weights.items()}
    floors = {name: int(x) for name, x in exact.items()}
    left = target - sum(floors.values())
    by_remainder = sorted(weights, key=lambda n: (-(exact[n] - floors[n]), list(weights).index(n)))
    for name in by_remainder[:left]:
        floors[name] += 1
    return floors


def traffic_summary(planned: list[PlannedVersion]) -> str:
    return ",".join(f"{p.name}={p.weight}" for p in planned)
