"""The two custom resources, InferenceModel and ModelVersion: the one source of their schema.

`crdgen.py` turns these models into the CRDs of crds/; the operator parses live objects with them. Every
rule that spans fields lives twice on purpose: as a pydantic validator here (for the operator, the control
plane and the tests) and as a CEL rule in `json_schema_extra` (for the API server, so `kubectl apply`
refuses a bad spec before the operator sees it). Bounds on every string and list keep the CEL cost
estimates of the API server within its limits.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from modelfleet.converters.formats import ACCELERATORS, DTYPES, FORMATS, hardware
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

GROUP = "modelfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# RE2-compatible (the API server's regex engine): no look-arounds.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
URI_PATTERN = r"^(file|pvc|https?|s3|hf)://.+$"
URI_SCHEMES = ("file", "pvc", "http", "https", "s3", "hf")
STICKY_BY_PATTERN = r"^(none|user|header:[A-Za-z0-9][-A-Za-z0-9_]*)$"
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
SHA256_PATTERN = r"^[a-f0-9]{64}$"
MAX_VERSIONS = 16
# As `modelfleet convert` refuses --quantize-lm-head without an int8/fp8 target.
LM_HEAD_NEEDS_QUANTIZATION = "quantizeLmHead applies to quantization int8 or fp8, not none"

Accelerator = Literal[ACCELERATORS]  # type: ignore[valid-type]
TargetFormat = Literal[FORMATS]  # type: ignore[valid-type]
TargetDtype = Literal[DTYPES]  # type: ignore[valid-type]
Quantization = Literal["none", "int8", "fp8"]
SourceFormat = Literal["hf-safetensors", "onnx"]
Phase = Literal["Pending", "Converting", "Ready", "Failed"]


def _rules(*rules: tuple[str, str]) -> dict[str, Any]:
    """CEL rules (rule, message) for the CRD schema of a model or field."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}


def _name_field(description: str, **kwargs: Any) -> Any:
    return Field(min_length=1, max_length=63, pattern=DNS_LABEL, description=description, **kwargs)


class _Model(BaseModel):
    """camelCase on the wire (as Kubernetes), snake_case in Python; unknown fields are ignored (pruned)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, protected_namespaces=(), extra="ignore"
    )


# --- shared ----------------------------------------------------------------------------------------------


class Condition(_Model):
    """The standard Kubernetes condition (metav1.Condition)."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=1024, min_length=1, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(max_length=32768)
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(default=None, ge=0)


def _conditions_field() -> Any:
    return Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


# --- InferenceModel --------------------------------------------------------------------------------------


class Toleration(_Model):
    """A pod toleration, as in the core API."""

    key: str | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


class Hardware(_Model):
    """Where the data-plane pods run: an accelerator class of the hardware table and devices per replica."""

    accelerator: Accelerator = Field(description="Hardware class, one of the fleet's hardware table.")
    count: int = Field(
        default=1,
        ge=1,
        le=16,
        description=(
            "Devices per replica (on cpu: engine processes). More than one splits each version's model "
            "over them (tensor parallelism: the engine's tensor_parallel_size); it must divide the "
            "model's attention heads."
        ),
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=32, description="Extra node labels, added to the class's label."
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)

    @field_validator("node_selector")
    @classmethod
    def _bounded_labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if len(key) > 316 or len(label) > 63:
                raise ValueError(f"label {key!r} is too long (keys up to 316, values up to 63 characters)")
        return value


class Replicas(_Model):
    """Data-plane replicas; an autoscaler moves between min and max when they differ."""

    # Defaulting fills in min and max before validation, so the guards loosen nothing for a stored object;
    # they keep the rule total on a value that was not defaulted (the API server checks defaults as written).
    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("!has(self.min) || !has(self.max) || self.min <= self.max", "min must be <= max")
        )
    )

    min: int = Field(default=1, ge=0, le=1000)
    max: int = Field(default=1, ge=1, le=1000)

    @model_validator(mode="after")
    def _min_le_max(self) -> Replicas:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max}); raise max or lower min")
        return self


class Speculative(_Model):
    """Speculative decoding: a proposer drafts tokens that one forward of the model verifies (the output
    is the model's own; greedy requests get exactly the tokens they get without it)."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "(has(self.proposer) && self.proposer == 'draft') == has(self.draftVersion)",
                "draftVersion is set exactly when proposer is draft",
            )
        )
    )

    proposer: Literal["none", "ngram", "draft"] = Field(
        default="none",
        description="none; ngram (drafts found in the prompt and output, no model); draft (a smaller "
        "ModelVersion of this model, draftVersion, with the same tokenizer).",
    )
    num_tokens: int = Field(default=4, ge=1, le=16, description="Draft tokens verified per step, at most.")
    draft_version: str | None = _name_field(
        "spec.version of the ModelVersion (of this model) whose torch artifact drafts; it needs no traffic.",
        default=None,
    )

    @model_validator(mode="after")
    def _draft_version_with_draft(self) -> Speculative:
        if (self.proposer == "draft") != (self.draft_version is not None):
            raise ValueError("draftVersion is set exactly when proposer is draft")
        return self


class Engine(_Model):
    """Engine settings of the data-plane pods."""

    max_model_len: int | None = Field(
        default=None, ge=16, le=1048576, description="Longest prompt + completion; default: the model's."
    )
    max_num_seqs: int = Field(default=256, ge=1, le=4096, description="Sequences running at once.")
    kv_cache_memory_fraction: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Share of the device memory left after the weights that the KV cache takes.",
    )
    kv_cache_bytes: int | None = Field(
        default=None,
        ge=1 << 16,
        le=1 << 40,
        description="KV-cache budget in bytes on the CPU (default 1 GiB); accelerators use "
        "kvCacheMemoryFraction.",
    )
    prefix_caching: bool = Field(default=True, description="Reuse KV blocks of shared prompt prefixes.")
    host_kv_cache_bytes: int = Field(
        default=0,
        ge=0,
        le=1 << 40,
        description="Host memory in bytes for prefix-cache KV blocks evicted from the device, copied back "
        "when a prompt's prefix hits them; 0 (default) is off.",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description="KV-cache element type: auto (the model's dtype) or fp8 (float8 e4m3, a static scale per "
        "layer for K and V: about twice the sequences in the same memory, logits within a small tolerance; "
        "GPUs of compute capability >= 8.9 such as L4, H100, H200, emulated on cpu).",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=16,
        le=1 << 20,
        description="Tokens one engine step carries at most, prompt chunks and decodes together; default: "
        "2048, and on GPUs 16 per maxNumSeqs between 2048 and 8192. Lower keeps the steps beside long "
        "prompts short (smaller inter-token gaps); higher admits more prompts in one step.",
    )
    prefill_wait_steps: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="Decode steps a waiting request may be held for others to join it (GPUs: a step with "
        "prompts in it costs more to launch than a decode step); default 8 on GPUs, 0: never held.",
    )
    speculative: Speculative = Field(default_factory=Speculative)


class TrafficEntry(_Model):
    """A share of the model's requests sent to one version."""

    version: str = _name_field("The ModelVersion's spec.version.")
    weight: int = Field(ge=0, le=100, description="Percent of requests, 0..100.")


class Routing(_Model):
    """How requests are spread over versions; `model: name@version` pins one regardless."""

    sticky_by: str = Field(
        default="none",
        max_length=128,
        pattern=STICKY_BY_PATTERN,
        description="none, user (the OpenAI `user` field) or header:<Name>.",
    )


class Thresholds(_Model):
    """Breaching any of these during a canary step rolls the candidate back."""

    max_error_rate: float = Field(default=0.01, ge=0, le=1, description="Share of failed requests.")
    max_p95_latency_ms: int | None = Field(default=None, ge=1, le=3600000)


class Rollout(_Model):
    """An automated canary: the candidate's weight climbs through `steps` every `interval`."""

    candidate: str = _name_field("Version that receives growing traffic.")
    steps: list[Annotated[int, Field(ge=1, le=100)]] = Field(
        default=[10, 50, 100],  # pydantic copies mutable defaults per instance
        min_length=1,
        max_length=20,
        description="Candidate weight at each step, strictly increasing, each 1..100.",
        json_schema_extra=_rules(
            (
                "self.isSorted() && self.all(s, self.exists_one(t, t == s))",
                "steps must be strictly increasing",
            )
        ),
    )
    interval: str = Field(
        default="5m",
        max_length=32,
        pattern=DURATION_PATTERN,
        description="How long each step runs before it is judged, e.g. 30s, 5m.",
    )
    min_requests: int = Field(
        default=20,
        ge=1,
        le=1000000,
        description="Candidate requests a step needs before it is judged; fewer and the step waits.",
    )
    thresholds: Thresholds = Field(default_factory=Thresholds)

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: list[int]) -> list[int]:
        if any(a >= b for a, b in itertools.pairwise(steps)):
            raise ValueError(f"steps must be strictly increasing, got {steps}")
        return steps


class Loading(_Model):
    """When the data plane loads a version's weights, and when it lets them go."""

    mode: Literal["lazy", "eager"] = Field(
        default="lazy", description="lazy: on the first request; eager: at pod start."
    )
    idle_unload_after: str | None = Field(
        default=None, max_length=32, pattern=DURATION_PATTERN, description="Unload a version idle this long."
    )


class InferenceModelSpec(_Model):
    """A stable endpoint that clients call by name, split over ModelVersions."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "!has(self.rollout) || self.traffic.exists(t, t.version == self.rollout.candidate)",
                "rollout.candidate must name a version listed in traffic",
            )
        )
    )

    hardware: Hardware
    replicas: Replicas = Field(default_factory=Replicas)
    engine: Engine = Field(default_factory=Engine)
    traffic: list[TrafficEntry] = Field(
        min_length=1,
        max_length=MAX_VERSIONS,
        description="Versions and their weights; the weights sum to 100.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["version"],
            **_rules(
                ("self.map(t, t.weight).sum() == 100", "weights must sum to 100"),
                ("self.all(t, self.exists_one(u, u.version == t.version))", "version names must be unique"),
            ),
        },
    )
    routing: Routing = Field(default_factory=Routing)
    rollout: Rollout | None = None
    loading: Loading = Field(default_factory=Loading)

    @field_validator("traffic")
    @classmethod
    def _valid_split(cls, traffic: list[TrafficEntry]) -> list[TrafficEntry]:
        names = [t.version for t in traffic]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"version names must be unique; repeated: {', '.join(repeated)}")
        total = sum(t.weight for t in traffic)
        if total != 100:
            split = ", ".join(f"{t.version}={t.weight}" for t in traffic)
            raise ValueError(f"weights must sum to 100, got {total} ({split})")
        return traffic

    @model_validator(mode="after")
    def _kv_cache_dtype_fits_the_hardware(self) -> InferenceModelSpec:
        # Refused here, with the model's status saying why, rather than by every pod at engine start.
        # cpu emulates an fp8 cache (for tests and the local fleet); GPUs need fp8 in the hardware table.
        accelerator = self.hardware.accelerator
        fp8_here = accelerator == "cpu" or "fp8" in hardware(accelerator).dtypes
        if self.engine.kv_cache_dtype == "fp8" and not fp8_here:
            raise ValueError(
                f"engine.kvCacheDtype fp8 needs an accelerator with fp8; {accelerator} has none: use auto"
            )
        return self

    @model_validator(mode="after")
    def _candidate_in_traffic(self) -> InferenceModelSpec:
        if self.rollout and self.rollout.candidate not in {t.version for t in self.traffic}:
            raise ValueError(
                f"rollout.candidate {self.rollout.candidate!r} is not in traffic; add it with weight 0"
            )
        return self


class VersionStatus(_Model):
    """What the operator serves of one version."""

    name: str = Field(max_length=63)
    phase: Phase | None = None
    weight: int = Field(default=0, ge=0, le=100, description="Weight actually served (0 until Ready).")
    ready_replicas: int = Field(default=0, ge=0)
    message: str | None = Field(default=None, max_length=1024)


RolloutPhase = Literal["Progressing", "Succeeded", "RolledBack", "Paused"]


class VersionMetrics(_Model):
    """What one version did during the last judged (or judging) window of a rollout step."""

    version: str = Field(max_length=63)
    requests: int = Field(default=0, ge=0)
    errors: int = Field(default=0, ge=0, description="Requests answered with a 5xx status.")
    error_rate: float | None = Field(default=None, ge=0, le=1)
    p95_latency_ms: float | None = Field(default=None, ge=0, description="From end-to-end latency buckets.")


class StatusCount(_Model):
    code: str = Field(max_length=8, description="HTTP status code.")
    count: float = Field(ge=0)


class BucketCount(_Model):
    le: str = Field(max_length=32, description="Upper bound in seconds, or +Inf.")
    count: float = Field(ge=0)


class VersionSample(_Model):
    """One pod's counters of one version: requests by status, cumulative end-to-end latency buckets."""

    version: str = Field(max_length=63)
    statuses: list[StatusCount] = Field(default_factory=list, max_length=64)
    buckets: list[BucketCount] = Field(default_factory=list, max_length=64)


class PodSample(_Model):
    name: str = Field(max_length=253)
    versions: list[VersionSample] = Field(default_factory=list, max_length=MAX_VERSIONS)


class RolloutSample(_Model):
    """The data-plane pods' counters when a step's window began (its metrics are deltas from these)."""

    taken_at: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    pods: list[PodSample] = Field(default_factory=list, max_length=1000)


class RolloutStatus(_Model):
    """Where the automated canary of spec.rollout stands; the operator's memory between its steps."""

    candidate: str = Field(max_length=63)
    phase: RolloutPhase
    step: int = Field(ge=0, le=20, description="Index into spec.rollout.steps.")
    step_started_at: str = Field(json_schema_extra={"format": "date-time"})
    spec_hash: str = Field(
        max_length=64, description="Digest of candidate, steps and spec.traffic; a change starts over."
    )
    baseline: list[TrafficEntry] = Field(
        default_factory=list, max_length=MAX_VERSIONS, description="The split restored on rollback."
    )
    traffic: list[TrafficEntry] = Field(
        default_factory=list, max_length=MAX_VERSIONS, description="The split the rollout serves now."
    )
    last_metrics: list[VersionMetrics] = Field(default_factory=list, max_length=MAX_VERSIONS)
    message: str = Field(default="", max_length=1024)
    sample: RolloutSample | None = None


class InferenceModelStatus(_Model):
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = _conditions_field()
    endpoint: str | None = Field(default=None, max_length=512, description="In-cluster URL of the API.")
    traffic: str | None = Field(default=None, max_length=1024, description="Served split, e.g. v1=90,v2=10.")
    ready_replicas: int = Field(default=0, ge=0)
    versions: list[VersionStatus] = Field(default_factory=list, max_length=MAX_VERSIONS)
    rollout: RolloutStatus | None = None


# --- ModelVersion ----------------------------------------------------------------------------------------


class SecretKey(_Model):
    """One key of a Secret in the ModelVersion's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    key: str = Field(default="token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class Source(_Model):
    """Where the original weights are."""

    uri: str = Field(
        min_length=1,
        max_length=2048,
        description=(
            "file://, pvc://<claim>/<path>, http(s)://, s3:// or hf://<org>/<name>[@<revision>] location "
            "of the weights."
        ),
        json_schema_extra={"pattern": URI_PATTERN},  # pydantic side: `_known_scheme` says what to use
    )
    format: SourceFormat = Field(default="hf-safetensors")
    sha256: str | None = Field(default=None, pattern=SHA256_PATTERN, max_length=64)
    token_secret: SecretKey | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token, given to the conversion as HF_TOKEN "
        "(private or gated hf:// repositories).",
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme not in URI_SCHEMES or not rest:
            raise ValueError(
                f"{uri!r} has no supported scheme; use one of {', '.join(s + '://' for s in URI_SCHEMES)}"
            )
        return uri


class Target(_Model):
    """One artifact to produce: the weights in a format and dtype for a hardware class."""

    accelerator: Accelerator
    format: TargetFormat
    dtype: TargetDtype


class ModelVersionSpec(_Model):
    """One immutable set of weights of an InferenceModel."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("self == oldSelf", "spec is immutable; create a new ModelVersion instead"),
            (
                "!has(self.quantizeLmHead) || !self.quantizeLmHead || "
                "(has(self.quantization) && self.quantization != 'none')",
                LM_HEAD_NEEDS_QUANTIZATION,
            ),
        )
    )

    model: str = _name_field("Name of the InferenceModel this version belongs to.")
    version: str = _name_field("Version name used in the model's traffic, e.g. v2.")
    source: Source
    quantization: Quantization = "none"
    quantize_lm_head: bool = Field(
        default=False,
        description="int8/fp8: quantize lm_head too (per vocabulary row) in the torch artifacts: faster "
        "decoding (it is the largest single matrix read per token), logits a little further from the "
        "source's. Default false: lm_head stays in the serving dtype.",
    )
    targets: list[Target] = Field(
        default_factory=list,
        max_length=16,
        description="Explicit conversion targets; empty: derived from the model's accelerator.",
    )

    @field_validator("quantize_lm_head")
    @classmethod
    def _lm_head_needs_quantization(cls, quantize_lm_head: bool, info: ValidationInfo) -> bool:
        # "quantization" is missing from info.data when it failed its own check (reported there).
        if quantize_lm_head and info.data.get("quantization", "int8") == "none":
            raise ValueError(
                f"{LM_HEAD_NEEDS_QUANTIZATION}; set quantization: int8 or fp8, or quantizeLmHead: false"
            )
        return quantize_lm_head


class Artifact(_Model):
    """A converted, validated artifact ready to serve."""

    accelerator: str = Field(max_length=63)
    format: str = Field(max_length=63)
    dtype: str = Field(max_length=63)
    uri: str = Field(max_length=2048)
    sha256: str | None = Field(default=None, max_length=64)
    size_bytes: int | None = Field(default=None, ge=0)
    validation: dict[str, Any] = Field(
        default_factory=dict, description="Checks against the source (logit difference, top-1 agreement)."
    )


class ModelVersionStatus(_Model):
    observed_generation: int | None = Field(default=None, ge=0)
    phase: Phase | None = None
    artifacts: list[Artifact] = Field(default_factory=list, max_length=16)
    conditions: list[Condition] = _conditions_field()


# --- whole objects ---------------------------------------------------------------------------------------


class _Object(_Model):
    api_version: str = Field(default=API_VERSION, max_length=253)
    kind: str
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("api_version")
    @classmethod
    def _our_group(cls, value: str) -> str:
        if value != API_VERSION:
            raise ValueError(f"must be {API_VERSION}, got {value!r}")
        return value


class InferenceModel(_Object):
    kind: Literal["InferenceModel"] = "InferenceModel"
    spec: InferenceModelSpec
    status: InferenceModelStatus | None = None


class ModelVersion(_Object):
    kind: Literal["ModelVersion"] = "ModelVersion"
    spec: ModelVersionSpec
    status: ModelVersionStatus | None = None
