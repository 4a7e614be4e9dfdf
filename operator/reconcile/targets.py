"""Which artifacts a ModelVersion needs: its explicit targets, or the defaults of its model's hardware."""

from __future__ import annotations

from modelfleet.converters.formats import Target, check_target, default_targets
from modelfleet.operator.api import ModelVersionSpec
from modelfleet.operator.reconcile.names import target_slug
from modelfleet.operator.settings import get_settings


class TargetError(ValueError):
    """No conversion can start; `reason` becomes the condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def resolve_targets(
    spec: ModelVersionSpec, accelerator: str | None, *, tensorrt: bool | None = None
) -> list[Target]:
    """The targets to convert to. `accelerator` is the InferenceModel's (None when it does not exist).

    `tensorrt`: whether the data-plane image carries TensorRT (default: MODELFLEET_DATAPLANE_TENSORRT,
    the chart's `dataplane.tensorrt`). Without it a TensorRT artifact could be built but never served,
    so no TensorRT target is planned.
    """
    targets = _explicit_targets(spec, tensorrt) if spec.targets else _default_targets(spec, accelerator)
    if spec.quantize_lm_head and not any(t.quantized_torch for t in targets):
        # Refused as the converter would refuse --quantize-lm-head: asked for, it must happen somewhere.
        slugs = ", ".join(target_slug(t) for t in targets)
        raise TargetError(
            "InvalidTarget" if spec.targets else "NoTargetForHardware",
            f"spec.quantizeLmHead: it applies to torch int8/fp8 targets, and this version has none "
            f"({slugs}); list one in spec.targets, or set quantizeLmHead: false",
        )
    return targets


def _explicit_targets(spec: ModelVersionSpec, tensorrt: bool | None) -> list[Target]:
    try:
        targets = [check_target(t.accelerator, t.format, t.dtype) for t in spec.targets]
    except ValueError as exc:
        raise TargetError("InvalidTarget", f"spec.targets: {exc}") from None
    if tensorrt is None:
        tensorrt = get_settings().dataplane_tensorrt
    if not tensorrt and any(t.format == "tensorrt" for t in targets):
        raise TargetError(
            "TensorRTUnavailable",
            "spec.targets: format 'tensorrt' needs a data-plane image with TensorRT, and this fleet's "
            "has none (chart value dataplane.tensorrt is false); use format torch or onnx",
        )
    return targets


def _default_targets(spec: ModelVersionSpec, accelerator: str | None) -> list[Target]:
    if accelerator is None:
        raise TargetError(
            "ModelNotFound",
            f"InferenceModel {spec.model!r} does not exist in this namespace; create it, or list "
            "spec.targets explicitly",
        )
    try:
        return default_targets(accelerator, spec.quantization)
    except ValueError as exc:
        raise TargetError("NoTargetForHardware", f"spec.quantization: {exc}") from None
