"""Assembling a server: settings + manifest -> DataPlane -> FastAPI app with its start-up and shut-down."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from modelfleet.dataplane import heap
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.server import loading
from modelfleet.dataplane.server.app import create_app
from modelfleet.dataplane.server.auth import KeyLimits, KeyStore
from modelfleet.dataplane.server.dataplane import DataPlane
from modelfleet.dataplane.server.gpu_sharing import MpsDaemon
from modelfleet.dataplane.server.metrics import ServerMetrics
from modelfleet.dataplane.server.model_manager import Loader, ModelManager, SizeEstimator
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.dataplane.server.tracing import tracer_from_env
from modelfleet.dataplane.server.watcher import ManifestWatcher
from opentelemetry.trace import Tracer

log = logging.getLogger("modelfleet.server")


def build_dataplane(
    settings: ServerSettings,
    *,
    tracer: Tracer | None = None,
    loader: Loader | None = None,
    estimate_bytes: SizeEstimator = loading.estimate_engine_bytes,
) -> DataPlane:
    """The data plane; `loader` defaults to loading.load_engine with the settings' stream relays."""
    if loader is None:
        loader = functools.partial(
            loading.load_engine,
            stream_relays=settings.stream_relays,
            send_timeout=settings.send_timeout_seconds,
        )
    holder: list[DataPlane] = []
    metrics = ServerMetrics(engines=lambda: holder[0].loaded_engines() if holder else ())
    manager = ModelManager(
        loader,
        estimate_bytes=estimate_bytes,
        close=loading.close_engine,
        memory_budget_bytes=settings.memory_budget_bytes,
        idle_unload_seconds=settings.idle_unload_seconds,
        load_retry_seconds=settings.load_retry_seconds,
        on_state=metrics.on_load_state,
        on_loaded=metrics.on_loaded,
        freeze_heap=settings.gc_freeze,
    )
    keys = KeyStore(
        settings.api_key_file,
        KeyLimits(settings.default_tokens_per_minute, settings.default_max_concurrent),
    )
    dataplane = DataPlane(settings, manager, keys=keys, metrics=metrics, tracer=tracer or tracer_from_env())
    holder.append(dataplane)
    return dataplane


def build_app(
    settings: ServerSettings,
    manifest: ServingManifest,
    *,
    manifest_path: Path | None = None,
    tracer: Tracer | None = None,
    loader: Loader | None = None,
    estimate_bytes: SizeEstimator = loading.estimate_engine_bytes,
) -> FastAPI:
    """The app; the manifest is applied (and preloads start) when the app starts up."""
    dataplane = build_dataplane(settings, tracer=tracer, loader=loader, estimate_bytes=estimate_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if dataplane.keys.open:
            log.warning("no API key file configured: the server is OPEN, every caller is accepted")
        else:
            log.info("API keys checked against %s", settings.api_key_file)
        mps = MpsDaemon() if settings.gpu_sharing == "mps" else None
        if mps is not None:
            mps.start()  # before the first engine process: a process joins MPS as it starts using CUDA
        dataplane.apply_manifest(manifest)
        dataplane.manager.start()
        dataplane.replicas.start()
        watcher = None
        if manifest_path is not None:
            watcher = ManifestWatcher(
                manifest_path,
                dataplane.apply_manifest,
                interval=settings.manifest_poll_seconds,
                on_result=lambda result: dataplane.metrics.manifest_reloads.labels(result).inc(),
            )
            watcher.start()
        grpc_server = None
        if settings.grpc_port:
            # Imported only when enabled; its server runs on this (uvicorn's) event loop.
            from modelfleet.dataplane.server.grpc.service import GrpcServer

            grpc_server = GrpcServer(dataplane, settings.host, settings.grpc_port)
            await grpc_server.start()
            app.state.grpc_port = grpc_server.port
        if settings.gc_freeze:
            # The start's heap, before any request (loads freeze theirs). No collection first: a start
            # leaves little garbage, and a full pass here costs ~0.3 s.
            heap.freeze()
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop()
            if watcher is not None:
                await watcher.stop()
            await dataplane.replicas.stop()
            await dataplane.close()
            if mps is not None:
                mps.stop()

    return create_app(dataplane, lifespan=lifespan)
