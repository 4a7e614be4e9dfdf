"""The transport-free facade behind every endpoint (REST, SSE, WebSocket).

One helper, `_start`, does what every OpenAI handler needs: resolve the model, route to a version,
apply the key's limits, lease the loaded version, check the prompt and parameters, wait for admission,
mirror shadow copies. It returns a `Generation` that either collects the full answer or streams chunks,
and releases everything it holds when it ends, however it ends (finished, failed, client gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.server import tracing as tr
from modelfleet.dataplane.server.admission import AdmissionQueue
from modelfleet.dataplane.server.auth import KeyStore, Principal, RateLimiter
from modelfleet.dataplane.server.engine_io import (
    ChoiceEvent,
    build_sampling_params,
    engine_max_model_len,
    merged_events,
)
from modelfleet.dataplane.server.errors import (
    BadRequest,
    EngineFailure,
    ModelNotFound,
    ModelUnavailable,
    PromptTooLong,
    ServerError,
)
from modelfleet.dataplane.server.metrics import ServerMetrics
from modelfleet.dataplane.server.model_manager import LoadState, ModelManager, VersionSlot, VersionSpec
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
from opentelemetry.trace import Span, Status, StatusCode, Tracer

log = logging.getLogger("modelfleet.server")

CLIENT_GONE = "499"  # the client closed the connection before the answer ended


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
        self.limiter = RateLimiter()
        self.admission = AdmissionQueue(settings.max_running, settings.max_waiting)
        self.manifest = ServingManifest()
        self.tables: dict[str, RoutingTable] = {}
        self.manifest_loaded = False
        self._shadow_tasks: set[asyncio.Task] = set()

    # -- manifest ------------------------------------------------------------------------------------

    def apply_manifest(self, manifest: ServingManifest) -> None:
        """Swap in a new manifest: new routing at once; removed versions unload once their requests end."""
        specs = [
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
        ready = self.manifest_loaded and self.manager.ready()
        return ready, {"ready": ready, "manifest_loaded": self.manifest_loaded, "versions": details}

    def loaded_engines(self):
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
        renderer: Renderer,
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
                self.limiter.acquire(ctx.principal)
                stack.callback(self.limiter.release, ctx.principal)
                slot = await stack.enter_async_context(self.manager.lease(model_name, version))
                prompts = renderer.prompt_token_ids(slot.engine.tokenizer)
                params = self._check(request, prompts, slot)
                with self.tracer.start_as_current_span("queue"):
                    self.metrics.queue_waiting.set(self.admission.waiting + 1)
                    try:
                        await stack.enter_async_context(self.admission.admit())
                    finally:
                        self.metrics.queue_waiting.set(self.admission.waiting)
                num_prompt = sum(len(p) for p in prompts) * request.n
                self.limiter.charge(ctx.principal, num_prompt)
                for shadow in decision_shadows:
                    self._mirror(model_name, shadow, prompts, params, request.n)
        except BaseException as exc:
            await stack.aclose()
            status = exc.status if isinstance(exc, ServerError) else 500
            # Unknown names stay out of the labels: clients must not be able to grow the metric series.
            label = model_name if model_name in self.tables else "_unknown"
            self.metrics.requests.labels(label, version, str(status)).inc()
            if isinstance(exc, ServerError) and exc.code in (
                "rate_limit_exceeded",
                "concurrency_limit_exceeded",
                "token_rate_limit_exceeded",
                "queue_full",
            ):
                self.metrics.rejected.labels(exc.code).inc()
            _end_span(span, exc)
            raise
        return Generation(
            dataplane=self,
            span=span,
            stack=stack,
            slot=slot,
            renderer=renderer,
            prompts=prompts,
            params=params,
            n=request.n,
            principal=ctx.principal,
            model=model_name,
            version=version,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            arrived=arrived,
        )

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

    def _check(self, request: Any, prompts: list[list[int]], slot: VersionSlot):
        """Limits the server and the model impose on the prompt and parameters; 400 naming the limit."""
        settings = self.settings
        max_model_len = engine_max_model_len(slot.engine)
        prompt_limit = settings.max_prompt_tokens or (max_model_len - 1 if max_model_len else 0)
        limit_name = "max_prompt_tokens" if settings.max_prompt_tokens else "the model's max_model_len - 1"
        for tokens in prompts:
            if not tokens:
                raise BadRequest("prompt: is empty; send at least one token", param="prompt")
            if prompt_limit and len(tokens) > prompt_limit:
                raise PromptTooLong(
                    f"prompt: has {len(tokens)} tokens, over the limit of {prompt_limit} ({limit_name}); "
                    "shorten it",
                    param="prompt",
                )
        max_tokens = _requested_max_tokens(request) or settings.default_max_tokens
        if max_tokens > settings.max_tokens_limit:
            raise BadRequest(
                f"max_tokens: {max_tokens} is over the server's limit of {settings.max_tokens_limit}",
                param="max_tokens",
            )
        if max_model_len and _requested_max_tokens(request):
            longest = max(len(p) for p in prompts)
            if longest + max_tokens > max_model_len:
                raise BadRequest(
                    f"max_tokens: the prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds the "
                    f"model's context of {max_model_len} tokens; lower max_tokens",
                    param="max_tokens",
                )
        if request.n > settings.max_n:
            raise BadRequest(f"n: {request.n} is over the server's limit of {settings.max_n}", param="n")
        top = _requested_logprobs(request)
        if top is not None and top > settings.max_logprobs:
            raise BadRequest(
                f"logprobs: {top} is over the server's limit of {settings.max_logprobs}", param="logprobs"
            )
        try:
            return build_sampling_params(request, max_tokens=max_tokens, logprobs=top)
        except ValueError as exc:
            param = str(exc).split(":", 1)[0]
            raise BadRequest(str(exc), param=param) from None

    def _mirror(self, model: str, version: str, prompts: list[list[int]], params, n: int) -> None:
        """Send a copy to a shadow version in the background; its answer is dropped, its outcome counted."""
        if len(self._shadow_tasks) >= self.settings.max_shadow_in_flight:
            self.metrics.shadow_requests.labels(model, version, "dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._run_shadow(model, version, prompts, params, n))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _run_shadow(self, model: str, version: str, prompts, params, n: int) -> None:
        started = time.monotonic()
        status = "ok"
        try:
            with self.tracer.start_as_current_span("shadow", attributes={tr.VERSION: version}):
                async with self.manager.lease(model, version) as slot:
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


class Generation:
    """A routed, admitted request: produce its answer once, as a whole or as chunks."""

    def __init__(
        self,
        *,
        dataplane: DataPlane,
        span: Span,
        stack: contextlib.AsyncExitStack,
        slot: VersionSlot,
        renderer: Renderer,
        prompts: list[list[int]],
        params,
        n: int,
        principal: Principal,
        model: str,
        version: str,
        include_usage: bool,
        arrived: float,
    ) -> None:
        self.dp = dataplane
        self.span = span
        self.stack = stack
        self.slot = slot
        self.renderer = renderer
        self.prompts = prompts
        self.params = params
        self.n = n
        self.principal = principal
        self.model = model
        self.version = version
        self.include_usage = include_usage
        self.request_id = renderer.response_id
        self.arrived = arrived
        self._closed = False

    async def response(self):
        """The whole answer (non-streaming)."""
        async with contextlib.aclosing(self._events()) as events:
            async for event in events:
                self.renderer.add(event)
        return self.renderer.response(self.slot.engine.tokenizer)

    async def chunks(self) -> AsyncIterator[Any]:
        """Streaming chunks. Usage comes as OpenAI sends it (an extra chunk) when the client asked with
        `stream_options.include_usage`; otherwise it rides on the chunk that finishes the last choice, so
        every answer carries its usage."""
        tokenizer = self.slot.engine.tokenizer
        opened = False
        num_choices, finished = len(self.prompts) * self.n, 0
        async with contextlib.aclosing(self._events()) as events:
            async for event in events:
                if not opened:  # opening chunks wait for the first token, so a refusal is still an HTTP error
                    opened = True
                    for chunk in self.renderer.opening_chunks():
                        yield chunk
                self.renderer.add(event)
                chunk = self.renderer.chunk(event, tokenizer)
                if event.finish_reason:
                    finished += 1
                    if finished == num_choices and not self.include_usage:
                        chunk.usage = self.renderer.usage()
                yield chunk
        if self.include_usage:
            yield self.renderer.usage_chunk()

    async def _events(self) -> AsyncIterator[ChoiceEvent]:
        """Engine outputs for all choices, with metrics, spans, token charges and cleanup."""
        dp, labels = self.dp, (self.model, self.version)
        itl, generated = dp.metrics.itl.labels(*labels), dp.metrics.generation_tokens.labels(*labels)
        status = "200"
        error: BaseException | None = None
        started = self.arrived
        first_token_at: float | None = None
        last_token_at: dict[int, float] = {}  # per choice: inter-token gaps never mix choices
        prefill = dp.tracer.start_span("prefill", context=trace.set_span_in_context(self.span))
        decode: Span | None = None
        try:
            stream = merged_events(self.slot.engine, self.prompts, self.params, self.n, self.request_id)
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if event.new_token_ids:
                        now = time.monotonic()
                        count = len(event.new_token_ids)
                        if first_token_at is None:
                            first_token_at = now
                            dp.metrics.ttft.labels(*labels).observe(now - started)
                            prefill.end()
                            decode = dp.tracer.start_span(
                                "decode", context=trace.set_span_in_context(self.span)
                            )
                        previous = last_token_at.get(event.index)
                        if previous is not None:
                            gap = (now - previous) / count
                            for _ in range(count):
                                itl.observe(gap)
                        last_token_at[event.index] = now
                        generated.inc(count)
                        dp.limiter.charge(self.principal, count)
                    if event.finish_reason == "error":
                        raise EngineFailure(
                            f"the engine failed this request: {event.error or 'unknown error'}"
                        )
                    yield event
        except GeneratorExit:
            status = CLIENT_GONE
            raise
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        except ServerError as exc:
            status, error = str(exc.status), exc
            raise
        except Exception as exc:
            status, error = "500", exc
            raise EngineFailure(f"the engine failed this request: {exc}") from exc
        finally:
            end = time.monotonic()
            if first_token_at is None:
                prefill.end()
            if decode is not None:
                decode.end()
            num_prompt = sum(len(p) for p in self.prompts) * self.n
            num_output = self.renderer.completion_tokens
            dp.metrics.prompt_tokens.labels(*labels).inc(num_prompt)
            dp.metrics.e2e.labels(*labels).observe(end - started)
            dp.metrics.requests.labels(*labels, status).inc()
            self.span.set_attribute(tr.INPUT_TOKENS, num_prompt)
            self.span.set_attribute(tr.OUTPUT_TOKENS, num_output)
            self.span.set_attribute(tr.RESPONSE_ID, self.request_id)
            self.span.set_attribute(tr.FINISH_REASONS, self.renderer.finish_reasons())
            if status == CLIENT_GONE:
                self.span.set_attribute("modelfleet.client_disconnected", True)
            _end_span(self.span, error)
            await self.aclose()

    async def aclose(self) -> None:
        """Release the lease, admission place and key slot (idempotent)."""
        if not self._closed:
            self._closed = True
            await self.stack.aclose()


def _end_span(span: Span, exc: BaseException | None) -> None:
    if exc is not None and not isinstance(exc, asyncio.CancelledError | GeneratorExit):
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.set_attribute("error.type", getattr(exc, "code", None) or type(exc).__name__)
    span.end()


def _route_error(exc: RouteError) -> ServerError:
    if exc.status == 404:
        return ModelNotFound(str(exc), param="model")
    return ModelUnavailable(str(exc), code=exc.code)


def _requested_max_tokens(request: Any) -> int | None:
    return getattr(request, "max_completion_tokens", None) or request.max_tokens


def _requested_logprobs(request: Any) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _optional_attrs(request: Any) -> dict[str, Any]:
    values = {
        tr.MAX_TOKENS: _requested_max_tokens(request),
        tr.TEMPERATURE: request.temperature,
        tr.TOP_P: request.top_p,
        tr.SEED: request.seed,
    }
    return {k: v for k, v in values.items() if v is not None}
