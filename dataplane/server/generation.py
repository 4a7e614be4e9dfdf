"""One admitted request producing its answer: as a whole or as stream chunks, with its metrics, spans,
token charges, and the release of everything it holds however it ends (finished, failed, client gone).

The facade (dataplane.py) builds a Generation and hands it what it needs; nothing here reaches back to
the facade (an import-linter contract keeps it so)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any, TypeAlias

from modelfleet.dataplane.engine.protocol import Engine
from modelfleet.dataplane.engine.stream_relay import StreamSink
from modelfleet.dataplane.sampling_params import SamplingParams
from modelfleet.dataplane.server import tracing as tr
from modelfleet.dataplane.server.auth import Principal, Reservation
from modelfleet.dataplane.server.engine_io import ChoiceEvent, merged_events
from modelfleet.dataplane.server.errors import ClientGone, EngineFailure, ServerError
from modelfleet.dataplane.server.metrics import ServerMetrics
from modelfleet.dataplane.server.render import ChatRenderer, CompletionRenderer
from modelfleet.dataplane.server.streaming import SocketSink
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

CLIENT_GONE = "499"  # the client closed the connection before the answer ended
AnswerRenderer: TypeAlias = CompletionRenderer | ChatRenderer


class Generation:
    """A routed, admitted request: produce its answer once, as a whole or as chunks."""

    def __init__(
        self,
        *,
        metrics: ServerMetrics,
        tracer: Tracer,
        span: Span,
        stack: contextlib.AsyncExitStack,
        engine: Engine,
        renderer: AnswerRenderer,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        principal: Principal,
        reservation: Reservation | None = None,
        model: str,
        version: str,
        include_usage: bool,
        arrived: float,
    ) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.span = span
        self.stack = stack
        self.engine = engine  # the one it was admitted to, even if its version reloads meanwhile
        self.renderer = renderer
        self.prompts = prompts
        self.params = params
        self.n = n
        self.principal = principal
        self.reservation = reservation
        self.model = model
        self.version = version
        self.include_usage = include_usage
        self.request_id = renderer.response_id
        self.arrived = arrived
        self._closed = False

    async def response(self) -> Any:
        """The whole answer (non-streaming)."""
        async with contextlib.aclosing(self._events()) as events:
            async for event in events:
                self.renderer.add(event)
        return self.renderer.response(self.engine.tokenizer)

    def chunks(self) -> AsyncGenerator[Any, None]:
        """Streaming chunks. Usage comes only as OpenAI sends it: a last chunk with no choices, when the
        client asked with `stream_options.include_usage`."""
        return self._chunks(encoded=False)

    def chunk_jsons(self, sink: StreamSink | None = None) -> AsyncGenerator[str, None]:
        """The same chunks as JSON text, as SSE sends them; a token's chunk is encoded without a model
        (Renderer.stream_json). With a `sink` (see relay_sink), a stream relay may write the chunks
        after the first token's to the sink's socket itself: they are then not among these."""
        return self._chunks(encoded=True, sink=sink)

    def relay_sink(self) -> SocketSink | None:
        """A sink for this stream's relay (streaming.SocketSink), where the engine has stream relays and
        the stream is one choice of text-only chunks; else None."""
        if not getattr(self.engine, "stream_relays", 0) or self.n != 1 or len(self.prompts) != 1:
            return None
        template = self.renderer.plain_template(0)
        if template is None:
            return None
        return SocketSink((template.head, template.middle, template.tail))

    async def _chunks(self, *, encoded: bool, sink: StreamSink | None = None) -> AsyncGenerator[Any, None]:
        renderer, tokenizer = self.renderer, self.engine.tokenizer
        opened = False
        async with contextlib.aclosing(self._events(sink)) as events:
            async for event in events:
                if not opened:  # opening chunks wait for the first token, so a refusal is still an HTTP error
                    opened = True
                    for chunk in renderer.opening_chunks():
                        yield chunk.model_dump_json() if encoded else chunk
                if event.relayed is not None:  # written by the relay: counted, not sent
                    relayed = event.relayed
                    tokens = sum(count for count, _ in relayed.counts)
                    renderer.count_written(event.index, tokens, relayed.finish_reason)
                elif encoded:
                    yield renderer.stream_json(event, tokenizer)
                else:
                    renderer.add(event)
                    yield renderer.chunk(event, tokenizer)
        if self.include_usage:
            usage = renderer.usage_chunk()
            yield usage.model_dump_json() if encoded else usage

    async def _events(self, sink: StreamSink | None = None) -> AsyncGenerator[ChoiceEvent, None]:
        """Engine outputs for all choices, with metrics, spans, token charges and cleanup."""
        metrics = self.metrics.of_version(self.model, self.version)
        counts = metrics.stream
        status = "200"
        error: BaseException | None = None
        started = self.arrived
        first_token_at: float | None = None
        last_token_at: dict[int, float] = {}  # per choice: inter-token gaps never mix choices
        prefill = self.tracer.start_span("prefill", context=trace.set_span_in_context(self.span))
        decode: Span | None = None
        try:
            stream = merged_events(self.engine, self.prompts, self.params, self.n, self.request_id, sink)
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if event.relayed is not None:  # the rest of the stream, as its relay timed it
                        for count, gap in event.relayed.counts:
                            counts.add(count, gap)
                        if event.relayed.client_gone:
                            raise ClientGone(f"request {self.request_id}: the client stopped reading")
                    elif event.new_token_ids:
                        now = time.monotonic()
                        count = len(event.new_token_ids)
                        if first_token_at is None:
                            first_token_at = now
                            metrics.ttft.observe(now - started)
                            prefill.end()
                            decode = self.tracer.start_span(
                                "decode", context=trace.set_span_in_context(self.span)
                            )
                        previous = last_token_at.get(event.index)
                        # tokens that came together share the gap since the choice's previous ones
                        counts.add(count, None if previous is None else (now - previous) / count)
                        last_token_at[event.index] = now
                        if sink is not None:
                            sink.last_output_at = now
                    if event.finish_reason == "error":
                        raise EngineFailure(
                            f"the engine failed this request: {event.error or 'unknown error'}"
                        )
                    yield event
        except (GeneratorExit, asyncio.CancelledError, ClientGone):
            status = CLIENT_GONE
            raise
        except ServerError as exc:
            status, error = str(exc.status), exc
            exc.counted = True  # below, under this version's labels
            raise
        except Exception as exc:
            status, error = "500", exc
            failure = EngineFailure(f"the engine failed this request: {exc}")
            failure.counted = True
            raise failure from exc
        finally:
            end = time.monotonic()
            if first_token_at is None:
                prefill.end()
            if decode is not None:
                decode.end()
            num_prompt = sum(len(p) for p in self.prompts) * self.n
            num_output = self.renderer.completion_tokens
            metrics.prompt_tokens.inc(num_prompt)
            metrics.e2e.observe(end - started)
            metrics.request_prompt_tokens.observe(num_prompt)
            metrics.request_generation_tokens.observe(num_output)
            self.metrics.requests.labels(self.model, self.version, status).inc()
            self.span.set_attribute(tr.INPUT_TOKENS, num_prompt)
            self.span.set_attribute(tr.OUTPUT_TOKENS, num_output)
            self.span.set_attribute(tr.RESPONSE_ID, self.request_id)
            self.span.set_attribute(tr.FINISH_REASONS, self.renderer.finish_reasons())
            if status == CLIENT_GONE:
                self.span.set_attribute("modelfleet.client_disconnected", True)
            end_span(self.span, error)
            if self.reservation is not None:
                self.reservation.used = num_prompt + num_output
            await self.aclose()

    async def aclose(self) -> None:
        """Release the lease, admission place and key slot (idempotent)."""
        if not self._closed:
            self._closed = True
            await self.stack.aclose()


def end_span(span: Span, exc: BaseException | None) -> None:
    if exc is not None and not isinstance(exc, asyncio.CancelledError | GeneratorExit):
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.set_attribute("error.type", getattr(exc, "code", None) or type(exc).__name__)
    span.end()
