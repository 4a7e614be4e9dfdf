"""OpenTelemetry tracing: a tracer from the standard OTEL_* variables, W3C traceparent propagation, and
the GenAI semantic-convention attribute names used on the request spans."""

from __future__ import annotations

import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "modelfleet.dataplane.server"
PROPAGATOR = TraceContextTextMapPropagator()

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
SEED = "gen_ai.request.seed"
CHOICE_COUNT = "gen_ai.request.choice.count"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
VERSION = "modelfleet.version"
ROUTE_REASON = "modelfleet.route.reason"


def tracer_from_env(service_name: str = "modelfleet-server") -> Tracer:
    return provider_from_env(service_name).get_tracer(TRACER_NAME)


def provider_from_env(service_name: str = "modelfleet-server") -> TracerProvider:
    """A tracer provider exporting where the OTEL_* variables say; with none set, spans are not sent.

    OTEL_TRACES_EXPORTER=otlp (or any OTEL_EXPORTER_OTLP_*ENDPOINT) -> OTLP over HTTP, which reads its
    own OTEL_EXPORTER_OTLP_* settings; `console` -> stdout; `none` -> nothing.
    """
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    has_endpoint = any(
        os.environ.get(v) for v in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp" or (has_endpoint and exporter_name != "none"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    else:
        # Spans nobody receives are not recorded: building one costs the event loop tens of us per
        # request. (With an exporter, OTEL_TRACES_SAMPLER decides, as the SDK reads it.)
        return TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
