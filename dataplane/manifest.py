"""The serving manifest: which models a data-plane pod serves, their versions, weights and routing.

The operator renders this type into a ConfigMap; `modelfleet serve --manifest FILE` reads it and watches
it for changes. Validation lives here so that both sides reject the same mistakes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Names end up in URLs, metric labels and `model@version` pins, so keep them to a safe alphabet.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
STICKY_PATTERN = re.compile(r"^(none|user|header:[A-Za-z0-9!#$%&'*+.^_`|~-]+)$")


class ManifestError(ValueError):
    """A manifest that cannot be served; the message is one line naming the field and the fix."""


def _check_name(value: str) -> str:
    if "@" in value:
        raise ValueError("must not contain '@' (it separates model and version in a pin 'model@version')")
    if not NAME_PATTERN.match(value):
        raise ValueError(f"{value!r} must start with a letter or digit and use only letters, digits, '._/-'")
    return value


class _Strict(BaseModel):
    # Unknown keys are typos in a hand-written manifest: reject them instead of ignoring them.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Routing(_Strict):
    """How a model's requests are spread over its versions."""

    stickyBy: str = "none"

    @field_validator("stickyBy")
    @classmethod
    def _check_sticky(cls, value: str) -> str:
        if not STICKY_PATTERN.match(value):
            raise ValueError(f"must be 'none', 'user' or 'header:<Name>', got {value!r}")
        return value

    @property
    def sticky_header(self) -> str | None:
        """The header name for `header:<Name>` routing, else None."""
        return self.stickyBy.split(":", 1)[1] if self.stickyBy.startswith("header:") else None

    @property
    def sticky_kind(self) -> Literal["none", "user", "header"]:
        return "header" if self.sticky_header else self.stickyBy  # type: ignore[return-value]


class ServedVersion(_Strict):
    """One immutable set of weights, served from a local directory."""

    name: str
    weight: int = Field(ge=0, le=100)
    artifact: str = Field(min_length=1)
    preload: bool = False
    shadow_percent: int = Field(default=0, ge=0, le=100)

    _name_ok = field_validator("name")(lambda cls, value: _check_name(value))


class ServedModel(_Strict):
    """A stable name that clients call; its versions share the traffic by weight."""

    name: str
    versions: list[ServedVersion] = Field(min_length=1)
    routing: Routing = Field(default_factory=Routing)
    engine: dict[str, Any] = Field(default_factory=dict)

    _name_ok = field_validator("name")(lambda cls, value: _check_name(value))

    @model_validator(mode="after")
    def _check_versions(self) -> ServedModel:
        names = [v.name for v in self.versions]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"version names must be unique within a model; repeated: {', '.join(duplicates)}"
            )
        total = sum(v.weight for v in self.versions)
        if total not in (0, 100):
            weights = ", ".join(f"{v.name}={v.weight}" for v in self.versions)
            raise ValueError(f"version weights must sum to 100 (or all be 0), got {total} ({weights})")
        return self

    def version(self, name: str) -> ServedVersion | None:
        return next((v for v in self.versions if v.name == name), None)


class ServingManifest(_Strict):
    """Everything one data-plane pod serves."""

    models: list[ServedModel] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_models(self) -> ServingManifest:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        return self

    def model(self, name: str) -> ServedModel | None:
        return next((m for m in self.models if m.name == name), None)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "manifest") -> ServingManifest:
        """Parse YAML (or JSON) text; any problem becomes one ManifestError line."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ManifestError(f"{source}: not valid YAML{where}; fix the syntax") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: top level must be a mapping with a 'models' list")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ManifestError(f"{source}: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    """The first validation problem as 'models[0].versions[1].weight: message'."""
    err = exc.errors()[0]
    path = ""
    for part in err["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = "unknown field; remove it or check its spelling"
    elif err["type"] == "missing":
        message = "required field is missing"
    more = len(exc.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{path or 'manifest'}: {message}{suffix}"


def load_manifest(path: str | Path) -> ServingManifest:
    """Read and validate a manifest file; raises ManifestError with one clear line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"manifest {path}: file not found; pass an existing file to --manifest") from None
    except OSError as exc:
        raise ManifestError(f"manifest {path}: cannot read it ({exc.strerror})") from None
    return ServingManifest.from_yaml(text, source=f"manifest {path}")


def single_model_manifest(model_dir: str | Path, *, name: str | None = None) -> ServingManifest:
    """The manifest behind `--model DIR`: one model, one version taking all traffic, loaded at start."""
    path = Path(model_dir)
    model_name = name or re.sub(r"[^A-Za-z0-9._\-]", "-", path.resolve().name).lstrip("-._") or "model"
    return ServingManifest(
        models=[
            ServedModel(
                name=model_name,
                versions=[ServedVersion(name="v1", weight=100, artifact=str(path), preload=True)],
            )
        ]
    )
