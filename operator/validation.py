"""Validate custom-resource objects (dicts from YAML or the API) into the models of `api.py`.

Every failure is one `InvalidResource` line naming the object, the field path in wire names (as a user
wrote it, e.g. `spec.traffic[1].weight`) and what to do.
"""

from __future__ import annotations

from typing import Any, TypeVar

from modelfleet.operator.api import API_VERSION, InferenceModel, ModelVersion
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)
KINDS: dict[str, type[BaseModel]] = {"InferenceModel": InferenceModel, "ModelVersion": ModelVersion}


class InvalidResource(ValueError):
    """A custom resource that does not satisfy its schema; the message is one line naming the field."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def field_path(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as a Kubernetes field path: ('spec', 'traffic', 1) -> spec.traffic[1]."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif str(part).startswith(("function-", "literal[")):
            continue  # pydantic's internal validator steps, not fields
        else:
            path += f".{part}" if path else str(part)
    return path


def _describe(error: dict[str, Any]) -> str:
    kind = error["type"]
    if kind == "missing":
        return "required field is missing; add it"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return f"{error['input']!r} is not allowed; use one of {expected}"
    if kind == "string_pattern_mismatch":
        return f"{error['input']!r} does not match {error['ctx']['pattern']}"
    return error["msg"].removeprefix("Value error, ")


def _name(obj: Any) -> str:
    if isinstance(obj, dict):
        meta = obj.get("metadata") or {}
        name = meta.get("name") if isinstance(meta, dict) else None
        return f"{obj.get('kind', 'object')} {name or '<unnamed>'}"
    return "object"


def validate_as(model: type[T], obj: Any) -> T:
    """Parse `obj` as `model`; raise InvalidResource on the first problem (and count the others)."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        where = field_path(first["loc"]) or "object"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidResource(f"{_name(obj)}: {where}: {_describe(first)}{more}", field=where) from None


def validate_inference_model(obj: Any) -> InferenceModel:
    return validate_as(InferenceModel, obj)


def validate_model_version(obj: Any) -> ModelVersion:
    return validate_as(ModelVersion, obj)


def validate_resource(obj: Any) -> InferenceModel | ModelVersion:
    """Validate an object of either kind, chosen by its `kind`."""
    kind = obj.get("kind") if isinstance(obj, dict) else None
    if kind not in KINDS:
        raise InvalidResource(
            f"{_name(obj)}: kind: {kind!r} is not one of ours; use InferenceModel or ModelVersion "
            f"({API_VERSION})",
            field="kind",
        )
    return validate_as(KINDS[kind], obj)  # type: ignore[return-value]
