"""Which artifacts a ModelVersion needs: its explicit targets, or the defaults of its model's hardware."""

from __future__ import annotations

from modelfleet.converters.formats import Target, check_target, default_targets
from modelfleet.operator.api import ModelVersionSpec


class TargetError(ValueError):
    """No conversion can start; `reason` becomes the condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def resolve_targets(spec: ModelVersionSpec, accelerator: str | None) -> list[Target]:
    """The targets to convert to. `accelerator` is the InferenceModel's (None when it does not exist)."""
    if spec.targets:
        try:
            return [check_target(t.accelerator, t.format, t.dtype) for t in spec.targets]
        except ValueError as exc:
            raise TargetError("InvalidTarget", f"spec.targets: {exc}") from None
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
