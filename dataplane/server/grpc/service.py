"""The gRPC service: each RPC authenticates like the HTTP routes, builds the same OpenAI request, and runs
it through the same DataPlane facade (routing, limits, admission, metrics, spans). Errors keep the HTTP
API's message text, under the gRPC status code matching its HTTP status."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc import aio
from modelfleet.dataplane.server import tracing as tr
from modelfleet.dataplane.server.auth import Principal
from modelfleet.dataplane.server.dataplane import UNKNOWN_MODEL, DataPlane, Generation, RequestContext
from modelfleet.dataplane.server.errors import BadRequest, ServerError, validation_message
from modelfleet.dataplane.server.grpc import proto
from modelfleet.dataplane.server.protocol import ChatCompletionRequest, CompletionRequest
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pydantic import ValidationError

log = logging.getLogger("modelfleet.server")

SERVICE = "modelfleet.v1.Inference"
VERSION_KEY = "x-modelfleet-version"
GRACE_SECONDS = 5.0  # requests in flight at shut-down get this long to end

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "top_k",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)
Metadata = Sequence[tuple[str, str]]


class InferenceService:
    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self.pb = proto.load()

    def handler(self) -> grpc.GenericRpcHandler:
        pb = self.pb
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate, pb.GenerateRequest.FromString, pb.GenerateChunk.SerializeToString
                ),
                "Completion": grpc.unary_unary_rpc_method_handler(
                    self.completion, pb.CompletionRequest.FromString, pb.Answer.SerializeToString
                ),
                "Chat": grpc.unary_unary_rpc_method_handler(
                    self.chat, pb.ChatRequest.FromString, pb.Answer.SerializeToString
                ),
            },
        )

    # -- RPCs ----------------------------------------------------------------------------------------

    async def generate(self, request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        kind = request.WhichOneof("request")
        span = self._span("Generate", context)
        generation: Generation | None = None
        error: ServerError | None = None
        try:
            if kind is None:
                raise BadRequest("request: set `completion` or `chat`", param="request")
            generation = await self._start(kind, getattr(request, kind), context, span, stream=True)
            chunks = generation.chunks()
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield self._chunk(chunk)
        except ServerError as exc:
            error = exc
        except Exception as exc:
            error = _internal(exc)
        finally:
            if generation is not None:  # a cancelled call ends here too: its engine request is aborted
                await generation.aclose()
            _end(span, error)
        if error is not None:
            await self._abort(context, error, generation)

    async def completion(self, request: Any, context: aio.ServicerContext) -> Any:
        return await self._answer("completion", request, context)

    async def chat(self, request: Any, context: aio.ServicerContext) -> Any:
        return await self._answer("chat", request, context)

    async def _answer(self, kind: str, request: Any, context: aio.ServicerContext) -> Any:
        span = self._span(kind.capitalize(), context)
        generation: Generation | None = None
        error: ServerError | None = None
        try:
            generation = await self._start(kind, request, context, span, stream=False)
            return self._whole(await generation.response())
        except ServerError as exc:
            error = exc
        except Exception as exc:
            error = _internal(exc)
        finally:
            if generation is not None:
                await generation.aclose()
            _end(span, error)
        await self._abort(context, error, generation)

    # -- the way into the facade ---------------------------------------------------------------------

    async def _start(
        self, kind: str, message: Any, context: aio.ServicerContext, span: Span, *, stream: bool
    ) -> Generation:
        dataplane = self.dataplane
        headers = _headers(context.invocation_metadata())
        dataplane.keys.refresh()
        caller: Principal = dataplane.keys.authenticate(headers.get("authorization"))
        ctx = RequestContext(principal=caller, headers=headers)
        with trace.use_span(span, end_on_exit=False):
            if kind == "chat":
                generation = await dataplane.chat(_chat_request(message, stream), ctx)
            else:
                generation = await dataplane.completion(_completion_request(message, stream), ctx)
        span.set_attribute(tr.VERSION, generation.version)
        context.set_trailing_metadata(((VERSION_KEY, generation.version),))
        return generation

    def _span(self, method: str, context: aio.ServicerContext) -> Span:
        parent = tr.PROPAGATOR.extract(_headers(context.invocation_metadata()))
        return self.dataplane.tracer.start_span(
            f"{SERVICE}/{method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method},
        )

    async def _abort(
        self, context: aio.ServicerContext, error: ServerError | None, generation: Generation | None
    ) -> Any:
        assert error is not None
        if not error.counted:  # refused before the facade saw a model (no key, bad request)
            self.dataplane.metrics.requests.labels(UNKNOWN_MODEL, "", str(error.status)).inc()
        trailing = [(name.lower(), value) for name, value in error.headers.items()]
        if generation is not None:
            trailing.append((VERSION_KEY, generation.version))
        code = STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)
        await context.abort(code, error.message, trailing_metadata=tuple(trailing))

    # -- answers -------------------------------------------------------------------------------------

    def _choices(self, choices: list[Any]) -> list[Any]:
        out = []
        for choice in choices:
            if hasattr(choice, "text"):
                text = choice.text
            else:
                part = getattr(choice, "delta", None) or getattr(choice, "message", None)
                text = (part.content if part is not None else None) or ""
            out.append(
                self.pb.Choice(index=choice.index, text=text, finish_reason=choice.finish_reason or "")
            )
        return out

    def _usage(self, usage: Any) -> Any:
        if usage is None:
            return None
        return self.pb.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )

    def _chunk(self, chunk: Any) -> Any:
        return self.pb.GenerateChunk(
            id=chunk.id,
            model=chunk.model,
            choices=self._choices(chunk.choices),
            usage=self._usage(chunk.usage),
            openai_json=chunk.model_dump_json(),
        )

    def _whole(self, answer: Any) -> Any:
        return self.pb.Answer(
            id=answer.id,
            model=answer.model,
            choices=self._choices(answer.choices),
            usage=self._usage(answer.usage),
            openai_json=answer.model_dump_json(),
        )


# -- requests: proto -> the OpenAI request the HTTP routes take --------------------------------------


def _fields(message: Any, stream: bool) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if message.extra_json:
        try:
            data = json.loads(message.extra_json)
        except json.JSONDecodeError:
            raise BadRequest("extra_json: not valid JSON; send a JSON object", param="extra_json") from None
        if not isinstance(data, dict):
            raise BadRequest("extra_json: must be a JSON object", param="extra_json")
    data["model"] = message.model
    if message.user:
        data["user"] = message.user
    sampling = message.sampling
    for name in SAMPLING_FIELDS:
        if sampling.HasField(name):
            data[name] = getattr(sampling, name)
    if sampling.stop:
        data["stop"] = list(sampling.stop)
    data["stream"] = stream
    if stream:  # the last chunk carries the usage, as the HTTP API's include_usage gives it
        data["stream_options"] = {"include_usage": True}
    else:
        data.pop("stream_options", None)
    return data


def _completion_request(message: Any, stream: bool) -> CompletionRequest:
    data = _fields(message, stream)
    if message.prompt:
        data["prompt"] = message.prompt
    return _validated(CompletionRequest, data)


def _chat_request(message: Any, stream: bool) -> ChatCompletionRequest:
    data = _fields(message, stream)
    if message.messages:
        data["messages"] = [{"role": m.role, "content": m.content} for m in message.messages]
    return _validated(ChatCompletionRequest, data)


def _validated(model: type[Any], data: dict[str, Any]) -> Any:
    try:
        return model(**data)
    except ValidationError as exc:
        text, param = validation_message(exc.errors())
        raise BadRequest(text, param=param) from None
    except RecursionError:
        raise BadRequest("extra_json: nested too deeply", param="extra_json") from None


def _headers(metadata: Metadata | None) -> dict[str, str]:
    """Text metadata as the facade's request headers (binary `-bin` entries are no header)."""
    return {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}


def _internal(exc: Exception) -> ServerError:
    log.exception("unexpected error in a gRPC call")
    return ServerError(f"internal error: {type(exc).__name__}", code="internal_error")


def _end(span: Span, error: ServerError | None) -> None:
    code = STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL) if error else grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if error is not None and error.status >= 500:
        span.set_status(Status(StatusCode.ERROR, error.message))
    span.end()


# -- the server ----------------------------------------------------------------------------------------


class GrpcServer:
    """A grpc.aio server on the running event loop (uvicorn's), so it shares the facade's asyncio objects."""

    def __init__(self, dataplane: DataPlane, host: str, port: int) -> None:
        limit = dataplane.settings.max_request_body_bytes  # the HTTP body limit, for messages too
        self.server = aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)]
        )
        self.server.add_generic_rpc_handlers((InferenceService(dataplane).handler(),))
        address = f"{_bracketed(host)}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises here, older versions return 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"gRPC: cannot listen on {address} (in use?); set MODELFLEET_GRPC_PORT to another")

    async def start(self) -> None:
        await self.server.start()
        log.info("gRPC on port %d (%s)", self.port, SERVICE)

    async def stop(self) -> None:
        started = time.monotonic()
        await self.server.stop(GRACE_SECONDS)
        log.info("gRPC stopped in %.1fs", time.monotonic() - started)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
