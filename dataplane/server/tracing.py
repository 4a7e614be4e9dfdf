"""OpenTelemetry tracing: a tracer from the standard OTEL_* variables, W3C traceparent propagation, and
the GenAI semantic-convention attribute names used on the request spans."""

from __future__ import annotations

from modelfleet.dataplane.observability import tracer_provider
from opentelemetry.sdk.trace import TracerProvider
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
    """The server's own provider, by the rule all three services share (see dataplane/observability.py)."""
    return tracer_provider(service_name)
