"""Operator settings: one pydantic-settings class, environment prefix MODELFLEET_ (names match the chart)."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
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
    log_level: str = "info"
    # A safety net: changes arrive as watch events. Each model's resync is a few GETs and no writes, so
    # 1,000 models at 300 s cost about 3 reconciles a second.
    resync_seconds: float = Field(
        default=300.0, gt=0, description="re-reconcile of a model no other trigger reconciled meanwhile"
    )

    rollout_tick_seconds: float = Field(
        default=10.0, gt=0, description="how often rollouts are checked (a step waits its interval)"
    )
    rollout_scrape_timeout_seconds: float = Field(default=5.0, gt=0, description="per data-plane pod")

    # What goes into the pods the operator creates.
    dataplane_image: str = "ghcr.io/modelfleet/modelfleet:0.1.0"
    dataplane_image_pull_policy: str = Field(default="IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")
    dataplane_image_pull_secrets: str = Field(default="", description="comma-separated Secret names")
    dataplane_api_keys_secret: str = Field(default="", description="Secret with the data plane's API keys")
    dataplane_port: int = Field(default=8000, ge=1, le=65535)
    dataplane_termination_grace_seconds: int = Field(
        default=120, ge=1, description="long enough for the longest stream to finish"
    )
    dataplane_otlp_endpoint: str = ""
    # Whether the data-plane image carries TensorRT (and so serves TensorRT artifacts); off by default,
    # as the image built from docker/dataplane.Dockerfile has none: TensorRT targets are then refused.
    dataplane_tensorrt: bool = False
    dataplane_cpu: str = "2"
    dataplane_memory: str = "16Gi"

    # The HorizontalPodAutoscaler (when replicas.max > replicas.min).
    # The data plane's per-pod count of requests not yet started (admission and engine queues).
    hpa_metric: str = Field(default="modelfleet_pod_requests_waiting", description="a per-pod metric")
    hpa_target_average: str = Field(default="4", description="target average of hpa_metric per pod")

    # Conversion Jobs.
    conversion_backoff_limit: int = Field(default=2, ge=0, le=10)
    conversion_deadline_seconds: int = Field(default=4 * 3600, ge=60)
    conversion_cpu: str = "4"
    conversion_memory: str = "32Gi"
    conversion_source_allow_hosts: str = Field(
        default="",
        description="http(s) source hosts conversion Jobs may fetch from (names, IPs, CIDRs; "
        "comma-separated); empty: any public address, never a private or link-local one",
    )

    # The model store: a PersistentVolumeClaim in each namespace, mounted at the same path everywhere.
    model_store_claim: str = "modelfleet-models"
    model_store_path: str = "/models"

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
