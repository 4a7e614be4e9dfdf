"""Request and response bodies, named by role: XCreate, XUpdate, XPublic."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from modelfleet.converters.formats import ACCELERATORS
from modelfleet.dataplane.errorbody import ErrorBody, ErrorDetail  # noqa: F401  (the one error shape)
from modelfleet.dataplane.jsonpaths import first_bad_string
from modelfleet.operator.api import (
    LM_HEAD_NEEDS_QUANTIZATION,
    STICKY_BY_PATTERN,
    Quantization,
    SourceFormat,
    TargetDtype,
    TargetFormat,
)
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Kubernetes object names: tenants, models and versions become namespaces and CR names; the ModelVersion
# CR is named `<model>-<version>`, which keeps the two together within a DNS label.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SHA256 = r"^[0-9a-f]{64}$"
STICKY_BY = re.compile(STICKY_BY_PATTERN)

Label = Annotated[str, StringConstraints(pattern=DNS_LABEL, min_length=1, max_length=63)]
ModelName = Annotated[str, StringConstraints(pattern=DNS_LABEL, min_length=1, max_length=40)]
VersionName = Annotated[str, StringConstraints(pattern=DNS_LABEL, min_length=1, max_length=22)]
Reason = Annotated[str, StringConstraints(max_length=2000)]
ModelPattern = Annotated[str, StringConstraints(pattern=r"^[a-z0-9*?\[\]-]+$", min_length=1, max_length=63)]


def _known_accelerator(value: str) -> str:
    if value not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {value!r}; use one of: {', '.join(ACCELERATORS)}")
    return value


def _sticky_by(value: str) -> str:
    if not STICKY_BY.match(value):
        raise ValueError("use 'none', 'user' or 'header:<Header-Name>'")
    return value


Accelerator = Annotated[str, AfterValidator(_known_accelerator)]
StickyBy = Annotated[str, AfterValidator(_sticky_by)]


# The Integer columns' range on PostgreSQL: larger numbers are refused here rather than by the database.
INT32_MAX = 2**31 - 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        found = first_bad_string(data, lambda text: "\x00" in text)
        if found:
            raise ValueError(f"{found}: contains a NUL character; remove it")
        return data


class Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    data: list[T]
    count: int  # all matches, not just this page
    limit: int
    offset: int


# Tenants


class TenantCreate(Strict):
    name: Label
    namespace: Label | None = Field(default=None, description="Kubernetes namespace; defaults to the name")
    gpu_quota: int = Field(default=0, ge=0, le=100_000)
    token_rate_limit: int = Field(
        default=0, ge=0, le=INT32_MAX, description="tokens per minute; 0 means unlimited"
    )
    allowed_models: list[ModelPattern] = Field(
        default_factory=list,
        max_length=100,
        description="model name patterns (fnmatch, e.g. chat-*); empty = any",
    )


class TenantUpdate(Strict):
    gpu_quota: int | None = Field(default=None, ge=0, le=100_000)
    token_rate_limit: int | None = Field(default=None, ge=0, le=INT32_MAX)
    allowed_models: list[ModelPattern] | None = Field(default=None, max_length=100)


class TenantPublic(Public):
    name: str
    namespace: str
    gpu_quota: int
    token_rate_limit: int
    allowed_models: list[str]
    created_at: datetime
    updated_at: datetime


# API keys


class ApiKeyCreate(Strict):
    name: Annotated[str, StringConstraints(min_length=1, max_length=100)] = "default"
    expires_in_days: int | None = Field(
        default=90,
        ge=1,
        le=3650,
        description="null: never expires (the admin's keys only: a key made by a tenant key expires no later "
        "than that key)",
    )


class ApiKeyPublic(Public):
    id: int
    name: str
    prefix: str
    created_at: datetime
    created_by: str
    expires_at: datetime | None
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyPublic):
    key: str = Field(description="the key itself; shown this once and never again")


# Models


class Hardware(Strict):
    accelerator: Accelerator = "cpu"
    count: int = Field(default=1, ge=1, le=16, description="devices per replica (on cpu: engine processes)")


class Replicas(Strict):
    min: int = Field(default=1, ge=0, le=1000)
    max: int = Field(default=1, ge=1, le=1000)

    @model_validator(mode="after")
    def _ordered(self) -> Replicas:
        if self.min > self.max:
            raise ValueError("replicas.min must not exceed replicas.max")
        return self


class TrafficEntry(Strict):
    version: VersionName
    weight: int = Field(ge=0, le=100)


def _valid_split(entries: list[TrafficEntry]) -> list[TrafficEntry]:
    names = [entry.version for entry in entries]
    if len(set(names)) != len(names):
        raise ValueError("each version may appear once")
    if entries and sum(entry.weight for entry in entries) != 100:
        raise ValueError(f"weights must sum to 100, got {sum(entry.weight for entry in entries)}")
    return entries


TrafficSplit = Annotated[list[TrafficEntry], AfterValidator(_valid_split)]


class ModelCreate(Strict):
    name: ModelName
    description: Annotated[str, StringConstraints(max_length=2000)] = ""
    hardware: Hardware = Field(default_factory=Hardware)
    replicas: Replicas = Field(default_factory=Replicas)
    sticky_by: StickyBy = "none"
    loading: Literal["lazy", "eager"] = "lazy"


class ModelUpdate(Strict):
    description: Annotated[str, StringConstraints(max_length=2000)] | None = None
    hardware: Hardware | None = None
    replicas: Replicas | None = None
    sticky_by: StickyBy | None = None
    loading: Literal["lazy", "eager"] | None = None
    expected_version: int | None = Field(
        default=None, ge=0, le=INT32_MAX, description="409 unless the model is at this version"
    )


class ModelPublic(Public):
    name: str
    tenant: str
    description: str
    hardware: Hardware
    replicas: Replicas
    sticky_by: str
    loading: str
    traffic: list[TrafficEntry]
    version: int = Field(description="optimistic-lock version; send it back as expected_version")
    created_at: datetime
    created_by: str
    updated_at: datetime
    status: dict[str, Any] | None = Field(default=None, description="live InferenceModel status, if any")


# Versions and artifacts


class Source(Strict):
    uri: Annotated[str, StringConstraints(pattern=r"^(file|pvc|https?|s3)://.+", max_length=2000)]
    format: SourceFormat = "hf-safetensors"
    sha256: Annotated[str, StringConstraints(pattern=SHA256)] | None = None


class Target(Strict):
    accelerator: Accelerator
    format: TargetFormat
    dtype: TargetDtype


class VersionCreate(Strict):
    version: VersionName
    source: Source
    quantization: Quantization = "none"
    quantize_lm_head: bool = Field(
        default=False, description="int8/fp8: quantize lm_head too (the ModelVersion's quantizeLmHead)"
    )
    parent: VersionName | None = Field(default=None, description="the version these weights derive from")
    targets: list[Target] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("quantize_lm_head")
    @classmethod
    def _lm_head_needs_quantization(cls, quantize_lm_head: bool, info: ValidationInfo) -> bool:
        # the CRD's rule, answered here as a 422 rather than by the API server when the CR is applied
        if quantize_lm_head and info.data.get("quantization", "int8") == "none":
            raise ValueError(f"{LM_HEAD_NEEDS_QUANTIZATION}; set quantization to int8 or fp8")
        return quantize_lm_head


class ArtifactPublic(Public):
    accelerator: str
    format: str
    dtype: str
    uri: str
    sha256: str | None
    size_bytes: int | None
    validation: dict[str, Any]
    updated_at: datetime


class VersionPublic(BaseModel):
    model: str
    version: str
    source: Source
    quantization: str
    quantize_lm_head: bool
    parent: str | None
    targets: list[Target]
    metadata: dict[str, Any]
    created_at: datetime
    created_by: str
    weight: int = Field(description="share of the model's traffic, percent")
    phase: str | None = Field(default=None, description="live ModelVersion phase, if a cluster is configured")
    artifacts: list[ArtifactPublic]


# Traffic and rollouts


class TrafficUpdate(Strict):
    traffic: Annotated[TrafficSplit, Field(min_length=1, max_length=16)]
    reason: Reason = ""
    expected_version: int | None = Field(
        default=None, ge=0, le=INT32_MAX, description="409 unless the model is at this version"
    )


class PromoteRequest(Strict):
    version: VersionName
    reason: Reason = ""
    expected_version: int | None = Field(default=None, ge=0, le=INT32_MAX)


class RollbackRequest(Strict):
    reason: Reason = ""
    expected_version: int | None = Field(default=None, ge=0, le=INT32_MAX)


class RolloutPublic(Public):
    id: int
    action: str
    from_weights: list[TrafficEntry]
    to_weights: list[TrafficEntry]
    reason: str
    actor: str
    state: str
    created_at: datetime


class AuditEventPublic(Public):
    id: int
    at: datetime
    actor: str
    tenant: str | None
    action: str
    target: str
    detail: dict[str, Any]


class Principal(BaseModel):
    """Who is calling: the admin, or a tenant through one of its keys."""

    role: Literal["admin", "tenant"]
    tenant: str | None = None
    key_prefix: str | None = None

    @property
    def actor(self) -> str:
        return "admin" if self.role == "admin" else f"{self.tenant}/key:{self.key_prefix}"

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"
