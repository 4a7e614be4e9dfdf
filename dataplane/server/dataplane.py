"""The transport-free facade behind every endpoint (REST, SSE, WebSocket).

One helper, `_start`, does what every OpenAI handler needs: resolve the model, route to a version,
apply the key's limits, lease the loaded version, check the prompt and parameters, wait for admission,
mirror shadow copies. It returns a `Generation` (generation.py) that either collects the full answer or
streams chunks, and releases everything it holds when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from modelfleet.dataplane.engine.protocol import Engine
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.sampling_params import SamplingParams
from modelfleet.dataplane.server import tracing as tr
from modelfleet.dataplane.server.admission import Admission
from modelfleet.dataplane.server.auth import KeyStore, Principal, RateLimiter
from modelfleet.dataplane.server.checks import (
    check_batch,
    check_prompt_chars,
    check_request,
    fit_default_max_tokens,
    requested_max_tokens,
)
from modelfleet.dataplane.server.engine_io import merged_events
from modelfleet.dataplane.server.errors import ModelNotFound, ModelUnavailable, ServerError
from modelfleet.dataplane.server.generation import CLIENT_GONE, AnswerRenderer, Generation, end_span
from modelfleet.dataplane.server.metrics import ServerMetrics
from modelfleet.dataplane.server.model_manager import LoadState, ModelManager, VersionSpec
from modelfleet.dataplane.server.peers import ReplicaCount
from modelfleet.dataplane.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    new_id,
)
from modelfleet.dataplane.server.render import ChatRenderer, CompletionRenderer, Renderer
from modelfleet.dataplane.server.router import RouteError, RoutingTable, route, split_model_field, sticky_key
from modelfleet.dataplane.server.settings import ServerSettings
from opentelemetry import trace
from opentelemetry.trace import Tracer

log = logging.getLogger("modelfleet.server")

UNKNOWN_MODEL = "_unknown"  # metric label for requests refused before a served model was known
INLINE_TOKENIZE_CHARS = 16_384  # longer prompt texts are tokenized off the event loop


@dataclass
class RequestContext:
    """What the transport knows about the caller."""

    principal: Principal
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names


class DataPlane:
    def __init__(
        self,
        settings: ServerSettings,
        manager: ModelManager,
        *,
        keys: KeyStore,
        metrics: ServerMetrics,
        tracer: Tracer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.keys = keys
        self.metrics = metrics
        self.tracer = tracer or trace.get_tracer(tr.TRACER_NAME)
        self.rng = rng or random.Random()
        self.replicas = ReplicaCount(
            settings.replicas, settings.peers_dns, poll_seconds=settings.peers_poll_seconds
        )
        self.limiter = RateLimiter(replicas=self.replicas)
        self.admission = Admission(settings.max_waiting, cap=settings.max_running)
        metrics.count_admission(self.admission.waiting_by_version)
        self.manifest = ServingManifest()
        self.tables: dict[str, RoutingTable] = {}
        self.manifest_loaded = False
        self._shadow_tasks: set[asyncio.Task[None]] = set()

    # -- manifest ------------------------------------------------------------------------------------

    def apply_manifest(self, manifest: ServingManifest) -> None:
        """Swap in a new manifest: new routing at once; removed versions unload once their requests end."""
        specs = version_specs(manifest)
        self.tables = {m.name: RoutingTable.from_model(m) for m in manifest.models}
        self.manifest = manifest
        self.manager.sync(specs)
        self.manifest_loaded = True

    # -- read-only views -----------------------------------------------------------------------------

    def list_models(self) -> ModelList:
        cards = []
        for model in self.manifest.models:
            cards.append(ModelCard(id=model.name))
            cards.extend(ModelCard(id=f"{model.name}@{v.name}", parent=model.name) for v in model.versions)
        return ModelList(data=cards)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        details = self.manager.details()
        weights = {(m.name, v.name): v.weight for m in self.manifest.models for v in m.versions}
        for d in details:
            d["weight"] = weights.get((d["model"], d["version"]))
        for d in details:
            slot = self.manager.slots.get((d["model"], d["version"]))
            if slot is not None and slot.state is LoadState.LOADED and slot.engine is not None:
                # What the engine really runs with, to compare with the manifest's engine settings.
                limits = slot.engine.limits
                d["max_num_seqs"] = limits.max_num_seqs
                d["max_model_len"] = limits.max_model_len
                d["admission_limit"] = self.admission.limit(d["max_num_seqs"])
                d["kv_cache_blocks"] = slot.engine.stats().num_total_blocks
        ready = self.manifest_loaded and self.manager.ready()
        return ready, {"ready": ready, "manifest_loaded": self.manifest_loaded, "versions": details}

    def loaded_engines(self) -> Iterator[tuple[str, str, Engine]]:
        for (model, version), slot in list(self.manager.slots.items()):
            if slot.state is LoadState.LOADED and slot.engine is not None:
                yield model, version, slot.engine

    # -- requests ------------------------------------------------------------------------------------

    async def completion(self, request: CompletionRequest, ctx: RequestContext) -> Generation:
        return await self._start(request, ctx, CompletionRenderer(request), operation="text_completion")

    async def chat(self, request: ChatCompletionRequest, ctx: RequestContext) -> Generation:
        return await self._start(request, ctx, ChatRenderer(request), operation="chat")

    async def _start(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        ctx: RequestContext,
        renderer: AnswerRenderer,
        *,
        operation: str,
    ) -> Generation:
        arrived = time.monotonic()
        model_name, pinned = split_model_field(request.model)
        span = self.tracer.start_span(
            f"{operation} {model_name}",
            attributes={
                tr.OPERATION: operation,
                tr.PROVIDER: "modelfleet",
                tr.REQUEST_MODEL: request.model,
                tr.CHOICE_COUNT: request.n,
                **_optional_attrs(request),
            },
        )
        stack = contextlib.AsyncExitStack()
        version = ""
        try:
            with trace.use_span(span, end_on_exit=False):
                version, decision_shadows = self._route(model_name, pinned, request, ctx)
                span.set_attribute(tr.VERSION, version)
                span.set_attribute(tr.RESPONSE_MODEL, f"{model_name}@{version}")
                check_batch(self.settings, request)
                self.limiter.acquire(ctx.principal)
                stack.callback(self.limiter.release, ctx.principal)
                slot = await stack.enter_async_context(self.manager.lease(model_name, version))
                engine = slot.engine
                assert engine is not None  # a lease holds a loaded version
                prompts = await self._tokenize(request, renderer, engine)
                params = check_request(self.settings, request, prompts, engine.limits.max_model_len)
                # The key pays for the prompt and the most it may generate before it runs; the rest
                # is given back when it ends (Generation sets what it used).
                sequences = len(prompts) * request.n
                fit_default_max_tokens(request, params, prompts, self.limiter.shares(ctx.principal.limits)[0])
                reserved = sum(len(p) for p in prompts) * request.n + params.max_tokens * sequences
                reservation = self.limiter.reserve(ctx.principal, reserved)
                stack.callback(self.limiter.settle, reservation)
                gate = self.admission.gate(model_name, version, engine.limits.max_num_seqs)
                with self.tracer.start_as_current_span("queue"):
                    self.metrics.queue_waiting.set(self.admission.waiting + 1)
                    try:
                        await stack.enter_async_context(gate.admit(sequences))
                    finally:
                        self.metrics.queue_waiting.set(self.admission.waiting)
                if slot.engine is None:  # its engine died while this request waited, and is reloading
                    raise ModelUnavailable(
                        f"version '{model_name}@{version}': its engine stopped while this request waited "
                        "and is loading again; retry",
                        code="engine_restarting",
                        retry_after=1.0,
                    )
                admitted = slot.engine  # a reloaded version's new engine, if it reloaded meanwhile
                for shadow in decision_shadows:
                    self._mirror(model_name, shadow, prompts, params, request.n)
        except BaseException as exc:
            await stack.aclose()
            if isinstance(exc, ServerError):
                status = str(exc.status)
                exc.counted = True  # here, below
            else:
                status = CLIENT_GONE if isinstance(exc, asyncio.CancelledError) else "500"
            # Unknown names stay out of the labels: clients must not be able to grow the metric series.
            label = model_name if model_name in self.tables else UNKNOWN_MODEL
            self.metrics.requests.labels(label, version, status).inc()
            if isinstance(exc, ServerError) and exc.code in (
                "rate_limit_exceeded",
                "concurrency_limit_exceeded",
                "token_rate_limit_exceeded",
                "queue_full",
            ):
                self.metrics.rejected.labels(exc.code).inc()
            end_span(span, exc)
            raise
        return Generation(
            metrics=self.metrics,
            tracer=self.tracer,
            span=span,
            stack=stack,
            engine=admitted,
            renderer=renderer,
            prompts=prompts,
            params=params,
            n=request.n,
            principal=ctx.principal,
            reservation=reservation,
            model=model_name,
            version=version,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            arrived=arrived,
        )

    async def _tokenize(self, request: Any, renderer: Renderer, engine: Engine) -> list[list[int]]:
        """Prompt token ids; a text too long for the model is refused before tokenizing, and a long one
        is tokenized on a worker thread, so the event loop (every other request, /health) never waits."""
        chars = check_prompt_chars(self.settings, request, engine.tokenizer, engine.limits.max_model_len)
        if chars > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(renderer.prompt_token_ids, engine.tokenizer)
        return renderer.prompt_token_ids(engine.tokenizer)

    def _route(
        self, model_name: str, pinned: str | None, request: Any, ctx: RequestContext
    ) -> tuple[str, tuple[str, ...]]:
        table = self.tables.get(model_name)
        if table is None:
            known = ", ".join(sorted(self.tables)) or "none"
            raise ModelNotFound(
                f"model '{request.model}' does not exist; served models: {known}", param="model"
            )
        with self.tracer.start_as_current_span("route") as span:
            key = sticky_key(table, user=request.user, headers=ctx.headers)
            try:
                decision = route(table, pinned=pinned, key=key, rng=self.rng)
            except RouteError as exc:
                raise _route_error(exc) from None
            span.set_attribute(tr.VERSION, decision.version)
            span.set_attribute(tr.ROUTE_REASON, decision.reason)
        return decision.version, decision.shadows

    def _mirror(
        self, model: str, version: str, prompts: list[list[int]], params: SamplingParams, n: int
    ) -> None:
        """Send a copy to a shadow version in the background; its answer is dropped, its outcome counted."""
        if len(self._shadow_tasks) >= self.settings.max_shadow_in_flight:
            self.metrics.shadow_requests.labels(model, version, "dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._run_shadow(model, version, prompts, params, n))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _run_shadow(
        self, model: str, version: str, prompts: list[list[int]], params: SamplingParams, n: int
    ) -> None:
        started = time.monotonic()
        status = "ok"
        try:
            with self.tracer.start_as_current_span("shadow", attributes={tr.VERSION: version}):
                async with self.manager.lease(model, version) as slot:
                    assert slot.engine is not None  # a lease holds a loaded version
                    async for event in merged_events(slot.engine, prompts, params, n, new_id("shadow")):
                        if event.finish_reason == "error":
                            status = "error"
        except Exception as exc:
            status = "error"
            log.warning("shadow request to %s@%s failed: %s", model, version, exc)
        self.metrics.shadow_requests.labels(model, version, status).inc()
        self.metrics.shadow_e2e.labels(model, version).observe(time.monotonic() - started)

    async def close(self) -> None:
        for task in list(self._shadow_tasks):
            task.cancel()
        await self.manager.close()


def _route_error(exc: RouteError) -> ServerError:
    if exc.status == 404:
        return ModelNotFound(str(exc), param="model")
    return ModelUnavailable(str(exc), code=exc.code)


def _optional_attrs(request: Any) -> dict[str, Any]:
    values = {
        tr.MAX_TOKENS: requested_max_tokens(request),
        tr.TEMPERATURE: request.temperature,
        tr.TOP_P: request.top_p,
        tr.SEED: request.seed,
    }
    return {k: v for k, v in values.items() if v is not None}


def version_specs(manifest: ServingManifest) -> list[VersionSpec]:
    """Each version of the manifest as the model manager loads it (its model's engine settings)."""
    return [
        VersionSpec(
            model=m.name,
            version=v.name,
            artifact=v.artifact,
            engine_config=tuple(sorted((k, json.dumps(val)) for k, val in m.engine.items())),
            preload=v.preload,
        )
        for m in manifest.models
        for v in m.versions
    ]
