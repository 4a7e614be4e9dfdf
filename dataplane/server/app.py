"""HTTP and WebSocket routes over the DataPlane facade; errors mapped once onto OpenAI's error body."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import typing
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from modelfleet.dataplane.server import tokenize as tk
from modelfleet.dataplane.server import tracing as tr
from modelfleet.dataplane.server.auth import Principal
from modelfleet.dataplane.server.dataplane import UNKNOWN_MODEL, DataPlane, Generation, RequestContext
from modelfleet.dataplane.server.errors import BadRequest, ServerError, error_body, validation_message
from modelfleet.dataplane.server.guard import RequestGuard, header
from modelfleet.dataplane.server.protocol import ChatCompletionRequest, CompletionRequest
from modelfleet.dataplane.server.streaming import ServerSendApp, SseResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("modelfleet.server")

VERSION_HEADER = "x-modelfleet-version"
_UNTRACED_PATHS = ("/health", "/ready", "/metrics")


class RedactApiKeys(logging.Filter):
    """uvicorn logs each WebSocket's path with its query string, where a browser client puts `api_key`."""

    PATTERN = re.compile(r"(api_key=)[^&\s\"']+")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "api_key=" in message:
            record.msg, record.args = self.PATTERN.sub(r"\1[redacted]", message), ()
        return True


def _redact_keys_in_server_logs() -> None:
    for name in ("uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactApiKeys) for f in logger.filters):
            logger.addFilter(RedactApiKeys())


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
T = TypeVar("T")


def create_app(dataplane: DataPlane, *, lifespan: Lifespan | None = None) -> FastAPI:
    _redact_keys_in_server_logs()
    # FastAPI's own OpenTelemetry off: HttpSpanMiddleware makes each request's server span (one, the
    # root of the engine's spans) and /metrics has the server's figures; FastAPI's would add a second
    # span and its own metrics wherever a global provider is set, and asks the providers every request.
    app = ServerSendApp(
        title="modelfleet", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False}
    )
    app.state.dataplane = dataplane
    app.add_middleware(HttpSpanMiddleware, tracer=dataplane.tracer)
    # Outermost: the key and the body's size and pace are checked before anything reads the body.
    app.add_middleware(RequestGuard, settings=dataplane.settings, dataplane=dataplane)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, detail = dataplane.readiness()
        return JSONResponse(detail, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(dataplane.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(_: Caller) -> dict:
        return dataplane.list_models().model_dump()

    async def completions(body: CompletionRequest, request: Request, caller: Caller) -> Response:
        generation = await dataplane.completion(body, _context(request, caller))
        return await _respond(generation, request, stream=body.stream)

    async def chat_completions(body: ChatCompletionRequest, request: Request, caller: Caller) -> Response:
        generation = await dataplane.chat(body, _context(request, caller))
        return await _respond(generation, request, stream=body.stream)

    for path, endpoint in (("/v1/completions", completions), ("/v1/chat/completions", chat_completions)):
        app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=JsonBodyRoute)

    @app.post("/tokenize")
    async def tokenize_route(body: tk.TokenizeRequest, _: Caller) -> dict:
        return (await tk.tokenize(dataplane, body)).model_dump()

    @app.post("/detokenize")
    async def detokenize_route(body: tk.DetokenizeRequest, _: Caller) -> dict:
        return (await tk.detokenize(dataplane, body)).model_dump()

    @app.get("/version")
    async def version() -> dict:
        return {"version": tk.modelfleet_version()}

    @app.websocket("/v1/stream")
    async def stream_socket(socket: WebSocket) -> None:
        await _serve_socket(dataplane, socket)

    return app


class JsonBodyRoute(APIRoute):
    """A route `endpoint(body, request, caller)` whose usual request (a whole JSON body its model accepts,
    from a caller the RequestGuard let in) is parsed here, skipping FastAPI's per-request layers (Request
    wrappers, exit stacks, dependency solving, a second key check): about a sixth of the server's CPU per
    streamed request (`bench/stream_overhead.py --output-len 2`). Any other request takes FastAPI's way,
    which answers it as before (errors included); an error the endpoint raises meets the same handlers."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.app = _json_body_app(self.app, typing.get_type_hints(endpoint)["body"], endpoint)


def _json_body_app(slow: ASGIApp, model: type[BaseModel], endpoint: Callable[..., Any]) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        try:
            principal = scope["state"]["principal"]  # the RequestGuard's: the key `_caller` checks again
            if message["type"] != "http.request" or message.get("more_body") or not _json_content(scope):
                raise ValueError("not a whole JSON body")
            body = model.model_validate(json.loads(message["body"]))
        except Exception:  # FastAPI's way reads it again, and refuses it as it always did
            await slow(scope, _replaying(message, receive), send)
            return
        response = await endpoint(body, Request(scope, receive, send), principal)
        await response(scope, receive, send)

    return app


def _json_content(scope: Scope) -> bool:
    """A `Content-Type` FastAPI parses as JSON too (application/json, any parameters)."""
    value = header(scope, b"content-type")
    return value is not None and value.partition(";")[0].strip().lower() == "application/json"


def _replaying(message: Message, receive: Receive) -> Receive:
    """`receive` with `message` (already taken from it) given again first."""
    pending = [message]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _caller(request: Request) -> Principal:
    # async: a sync dependency would hop to the thread pool and back on every request, for a stat and
    # a hash
    keys = request.app.state.dataplane.keys
    keys.refresh()
    return keys.authenticate(request.headers.get("authorization"))


Caller = Annotated[Principal, Depends(_caller)]


def _context(request: Request | WebSocket, caller: Principal) -> RequestContext:
    return RequestContext(principal=caller, headers={k.lower(): v for k, v in request.headers.items()})


async def _respond(generation: Generation, request: Request, *, stream: bool) -> Response:
    headers = {VERSION_HEADER: generation.version}
    if not stream:
        answer = await _until_disconnect(request, generation.response())
        if answer is None:  # nobody is listening any more; the request was aborted
            return Response(status_code=499)
        return JSONResponse(answer.model_dump(mode="json"), headers=headers)
    sink = generation.relay_sink()
    chunks = generation.chunk_jsons(sink)
    try:
        # Wait for the first token before sending headers: a request the engine refuses is still a 4xx.
        first = await anext(chunks, None)
    except BaseException:
        await chunks.aclose()
        raise
    return SseResponse(first, chunks, headers=headers, sink=sink)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run a non-streaming answer; if the client leaves first, cancel it (aborting the engine request) and
    return None."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return None
    try:
        return await task
    except asyncio.CancelledError:
        if task.cancelled():  # cancelled here because the client left, not from outside
            return None
        raise


async def _serve_socket(dataplane: DataPlane, socket: WebSocket) -> None:
    """Each JSON message is a completion (`prompt`) or chat (`messages`) request; answers stream back as
    `{"type": "chunk", ...}` messages between `start` and `done` (or `error`)."""
    await socket.accept()
    try:
        dataplane.keys.refresh()
        token = socket.headers.get("authorization") or (
            f"Bearer {socket.query_params['api_key']}" if "api_key" in socket.query_params else None
        )
        caller = dataplane.keys.authenticate(token)
    except ServerError as exc:
        await socket.send_json({"type": "error", **exc.body()})
        await socket.close(code=1008)
        return
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            message = await socket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is None:
                error = BadRequest("binary frames are not supported; send each request as a JSON text frame")
                await socket.send_json({"type": "error", **error.body()})
                continue
            await _socket_request(dataplane, socket, message["text"], caller)


async def _send_within(dataplane: DataPlane, socket: WebSocket, data: dict) -> None:
    """A client that reads nothing would block this send for good, holding its request's places."""
    try:
        await asyncio.wait_for(socket.send_json(data), dataplane.settings.send_timeout_seconds)
    except TimeoutError:
        dataplane.metrics.client_timeouts.labels("send").inc()
        raise WebSocketDisconnect(code=1008, reason="the client stopped reading") from None


async def _socket_request(dataplane: DataPlane, socket: WebSocket, message: str, caller: Principal) -> None:
    send = functools.partial(_send_within, dataplane, socket)
    generation: Generation | None = None
    with dataplane.tracer.start_as_current_span("WS /v1/stream", kind=SpanKind.SERVER):
        try:
            try:
                data = json.loads(message)
                if not isinstance(data, dict):
                    raise BadRequest("request must be a JSON object")
                ctx = _context(socket, caller)
                if "messages" in data:
                    generation = await dataplane.chat(ChatCompletionRequest(**data), ctx)
                else:
                    generation = await dataplane.completion(CompletionRequest(**data), ctx)
            except json.JSONDecodeError:
                raise BadRequest("request is not valid JSON; send a JSON object") from None
            except RecursionError:
                raise BadRequest("request is nested too deeply; send a flat JSON object") from None
            except ValidationError as exc:
                text, param = validation_message(exc.errors())
                raise BadRequest(text, param=param) from None
            start = {"type": "start", "id": generation.request_id, "version": generation.version}
            await send(start)
            chunks = generation.chunks()
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    await send({"type": "chunk", **chunk.model_dump(mode="json")})
            await send({"type": "done", "usage": generation.renderer.usage().model_dump()})
        except ServerError as exc:
            await send({"type": "error", **exc.body()})
        except WebSocketDisconnect:
            raise
        except Exception as exc:  # one failed request never takes the socket (and its other requests) down
            log.exception("unexpected error on the WebSocket")
            body = error_body(
                f"internal error: {type(exc).__name__}", type_="server_error", code="internal_error"
            )
            await send({"type": "error", **body})
        finally:
            if generation is not None:  # gone before its chunks were read: release what it holds
                await generation.aclose()


class HttpSpanMiddleware:
    """The root span of each HTTP request, continuing a W3C `traceparent` from the client. Plain ASGI, so
    the span stays open until a streamed body has been sent to the end."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        parent = tr.PROPAGATOR.extract(carrier)
        method, path = scope["method"], scope["path"]
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        status: list[int] = []

        async def send_with_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                span.set_attribute("http.response.status_code", message["status"])
                for name, value in message.get("headers", ()):
                    if name.decode("latin-1").lower() == VERSION_HEADER:
                        span.set_attribute(tr.VERSION, value.decode("latin-1"))
            await send(message)

        try:
            with trace.use_span(span, end_on_exit=False):
                await self.app(scope, receive, send_with_status)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if status and status[0] >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()


def _install_error_handlers(app: FastAPI) -> None:
    def count(request: Request, status: int) -> None:
        # Refusals before the facade saw the request (bad JSON, no key): no model is known yet.
        request.app.state.dataplane.metrics.requests.labels(UNKNOWN_MODEL, "", str(status)).inc()

    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        if not exc.counted:
            count(request, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(request, 400)
        message, param = validation_message(list(exc.errors()))
        body = error_body(message, type_="invalid_request_error", param=param, code="invalid_request")
        return JSONResponse(body, status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        message = f"internal error: {type(exc).__name__}"
        body = error_body(message, type_="server_error", code="internal_error")
        return JSONResponse(body, status_code=500)
