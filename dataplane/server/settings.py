"""Server settings: one pydantic-settings class, environment prefix MODELFLEET_."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MODELFLEET_", extra="ignore")

    host: str = Field(default="0.0.0.0", description="address the server listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="port the server listens on")
    grpc_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="port of the gRPC API (service modelfleet.v1.Inference, on the same address); 0: no gRPC",
    )
    manifest: Path | None = Field(
        default=None, description="the serving manifest (models and versions) the server follows"
    )
    manifest_poll_seconds: float = Field(
        default=1.0, gt=0, description="how often the manifest file is checked"
    )

    # Model manager.
    memory_budget_bytes: int = Field(
        default=0, ge=0, description="bytes of loaded versions (weights + KV cache); 0 means no budget"
    )
    idle_unload_seconds: float = Field(default=0.0, ge=0, description="0 keeps idle versions loaded")
    load_retry_seconds: float = Field(default=30.0, ge=0, description="how long a failed load is not retried")

    # Auth and limits.
    api_key_file: Path | None = Field(
        default=None,
        description="a file of sha256 hex digests of the API keys, or JSON with per-key limits; "
        "none: every caller is accepted",
    )
    default_tokens_per_minute: int = Field(default=0, ge=0, description="per key; 0 means unlimited")
    default_max_concurrent: int = Field(default=0, ge=0, description="per key; 0 means unlimited")

    # Admission, per loaded version: as many requests run as its engine runs sequences at once (the
    # manifest's engine max_num_seqs); the rest wait.
    max_running: int = Field(
        default=0,
        ge=0,
        description="requests running at once per version, at most its engine's max_num_seqs; "
        "0: max_num_seqs",
    )
    max_waiting: int = Field(
        default=256, ge=0, description="requests waiting in the whole server; past it, 429"
    )

    # Request limits (the engine's max model length applies too).
    max_prompt_tokens: int = Field(default=0, ge=0, description="0 means the model's limit")
    max_tokens_limit: int = Field(default=4096, ge=1, description="the largest max_tokens a request may ask")
    max_n: int = Field(default=8, ge=1, description="the largest n (choices) a request may ask")
    default_max_tokens: int = Field(default=16, ge=1, description="max_tokens of a request that sets none")
    max_logprobs: int = Field(default=20, ge=0, description="the most logprobs a request may ask")

    max_shadow_in_flight: int = Field(
        default=16,
        ge=0,
        description="shadow copies running at once in the background; past it they are dropped, never queued",
    )

    # What a client may hold and for how long: no connection, body or admission place is held by a
    # client that is slow or gone. Bodies past the limit get 413 before they are read.
    max_request_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="larger bodies (and WebSocket messages) are refused, 413",
    )
    header_timeout_seconds: float = Field(default=10.0, gt=0, description="connection open to request head")
    body_timeout_seconds: float = Field(default=30.0, gt=0, description="request head to the body's end")
    keep_alive_timeout_seconds: float = Field(default=5.0, gt=0, description="idle between requests")
    send_timeout_seconds: float = Field(
        default=30.0, gt=0, description="a response the client does not read for this long is aborted"
    )
    max_batch_prompts: int = Field(default=64, ge=1, description="prompts in one completion request")
    stream_relays: int | None = Field(
        default=None,
        ge=0,
        description="processes that write streamed answers to clients for an engine in its own process (a "
        "GPU engine), so that one server process is not what limits tokens/s; 0: the server writes them; "
        "unset: one per 64 sequences of the engine's max_num_seqs (loading.STREAMS_PER_RELAY)",
    )

    gc_freeze: bool = Field(
        default=True,
        description="keep what the server process holds once started, and once each version has loaded, "
        "out of the garbage collector's full passes, each a pause of every request (dataplane/heap.py); an "
        "unload collects once. false: the collector walks it all, as Python does by default (a GPU engine "
        "keeps its own heap out regardless)",
    )

    gpu_sharing: Literal["none", "mps"] = Field(
        default="none",
        description="how the engine processes of versions on one NVIDIA GPU share it: mps, through an MPS "
        "control daemon (the node's, where CUDA_MPS_PIPE_DIRECTORY is set, else one the server starts), so "
        "their kernels run concurrently; none: the GPU time-slices between them",
    )

    # Per-key limits are shared by the replicas serving a model: each enforces 1/replicas of them. The
    # count is `replicas`, or the live number of addresses of `peers_dns` (a headless Service's name).
    replicas: int = Field(default=1, ge=1, description="servers sharing each API key's limits")
    peers_dns: str | None = Field(
        default=None, description="a headless Service whose addresses count the replicas (live)"
    )
    peers_poll_seconds: float = Field(default=10.0, gt=0, description="how often peers_dns is resolved")
