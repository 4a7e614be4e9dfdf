"""Operator settings: one pydantic-settings class, environment prefix MODELFLEET_ (names match the chart)."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MODELFLEET_", extra="ignore")

    # The operator process itself.
    operator_peering: str = Field(default="modelfleet", description="kopf peering object name")
    operator_standalone: bool = Field(default=False, description="run without peering (development only)")
    operator_priority: int | None = Field(
        default=None, ge=1, le=32767, description="peering priority; empty: a random one per process"
    )
    operator_namespaces: str = Field(default="", description="comma-separated; empty: all namespaces")
    operator_metrics_port: int = Field(default=9090, ge=0, le=65535, description="0: no metrics server")
    operator_health_port: int = Field(default=8080, ge=0, le=65535, description="0: no liveness endpoint")
    log_level: str = Field(
        default="info", description="the operator's log level (debug, info, warning, error)"
    )
    # 1,000 models at 300 s cost about 3 reconciles a second: each resync is a few GETs and no writes.
    resync_seconds: float = Field(
        default=300.0,
        gt=0,
        description="re-reconcile of a model no other trigger reconciled meanwhile (a safety net: "
        "changes arrive as watch events)",
    )

    rollout_tick_seconds: float = Field(
        default=10.0, gt=0, description="how often rollouts are checked (a step waits its interval)"
    )
    rollout_scrape_timeout_seconds: float = Field(
        default=5.0, gt=0, description="timeout of a rollout's metrics scrape, per data-plane pod"
    )

    # What goes into the pods the operator creates.
    dataplane_image: str = Field(
        default="ghcr.io/modelfleet/modelfleet:0.1.0", description="image of the data-plane pods"
    )
    dataplane_image_pull_policy: str = Field(
        default="IfNotPresent",
        pattern="^(Always|IfNotPresent|Never)$",
        description="imagePullPolicy of the data-plane and conversion containers",
    )
    dataplane_image_pull_secrets: str = Field(default="", description="comma-separated Secret names")
    dataplane_api_keys_secret: str = Field(default="", description="Secret with the data plane's API keys")
    dataplane_port: int = Field(default=8000, ge=1, le=65535, description="port the data-plane pods serve on")
    dataplane_grpc_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="port of the data-plane pods' gRPC API (container and Service port 'grpc'); 0: no gRPC",
    )
    dataplane_termination_grace_seconds: int = Field(
        default=120, ge=1, description="long enough for the longest stream to finish"
    )
    dataplane_otlp_endpoint: str = Field(
        default="", description="OTEL_EXPORTER_OTLP_ENDPOINT of the data-plane pods; empty: no traces"
    )
    dataplane_log_format: str = Field(
        default="",
        pattern="^(|text|json)$",
        description="MODELFLEET_LOG_FORMAT of the data-plane pods (text, or json: one object a line with "
        "trace ids); empty: not set, so text",
    )
    dataplane_tensorrt: bool = Field(
        default=False,
        description="the data-plane image carries TensorRT and so serves TensorRT artifacts; off: "
        "TensorRT targets are refused (docker/dataplane.Dockerfile builds an image without it)",
    )
    dataplane_cpu: str = Field(default="2", description="CPU request of a data-plane pod")
    dataplane_stream_relays: int | None = Field(
        default=None,
        ge=0,
        description="stream relay processes per engine of a GPU data-plane pod (its "
        "MODELFLEET_STREAM_RELAYS); unset: the server sizes them from each engine's max_num_seqs",
    )
    dataplane_gpu_sharing: str = Field(
        default="mps",
        pattern="^(mps|none)$",
        description="how the versions of a one-GPU NVIDIA data-plane pod share it (its "
        "MODELFLEET_GPU_SHARING): mps, their kernels run concurrently under an MPS daemon; none: the GPU "
        "time-slices between their engine processes",
    )
    dataplane_memory: str = Field(default="16Gi", description="memory request and limit of a data-plane pod")

    # The HorizontalPodAutoscaler (when replicas.max > replicas.min).
    hpa_metric: str = Field(
        default="modelfleet_pod_requests_waiting",
        description="a per-pod metric the autoscaler follows (the default: requests not yet started)",
    )
    hpa_target_average: str = Field(default="4", description="target average of hpa_metric per pod")

    # Conversion Jobs.
    conversion_backoff_limit: int = Field(
        default=2, ge=0, le=10, description="retries of a failed conversion Job"
    )
    conversion_deadline_seconds: int = Field(
        default=4 * 3600, ge=60, description="a conversion Job running longer is stopped"
    )
    conversion_cpu: str = Field(default="4", description="CPU request of a conversion Job")
    conversion_memory: str = Field(default="32Gi", description="memory request and limit of a conversion Job")
    conversion_source_allow_hosts: str = Field(
        default="",
        description="http(s) source hosts conversion Jobs may fetch from (names, IPs, CIDRs; "
        "comma-separated); empty: any public address, never a private or link-local one",
    )

    # The model store: a PersistentVolumeClaim in each namespace, mounted at the same path everywhere.
    model_store_claim: str = Field(
        default="modelfleet-models", description="PersistentVolumeClaim of the model store, in each namespace"
    )
    model_store_path: str = Field(default="/models", description="where the model store is mounted in pods")

    @model_validator(mode="after")
    def _distinct_ports(self) -> OperatorSettings:
        if self.dataplane_grpc_port == self.dataplane_port:
            raise ValueError(
                f"MODELFLEET_DATAPLANE_GRPC_PORT {self.dataplane_grpc_port} is the HTTP port; "
                "pick another, or 0 for no gRPC"
            )
        return self

    @property
    def namespaces(self) -> list[str]:
        return _split(self.operator_namespaces)

    @property
    def image_pull_secrets(self) -> list[str]:
        return _split(self.dataplane_image_pull_secrets)

    @property
    def artifacts_root(self) -> str:
        return f"{self.model_store_path.rstrip('/')}/artifacts"


@lru_cache(maxsize=1)
def get_settings() -> OperatorSettings:
    return OperatorSettings()
