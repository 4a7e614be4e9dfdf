"""Live-server behaviour: lazy loading, load failures, manifest changes under load, client disconnects,
tracing and metrics (real engine, tiny demo models)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter

import httpx
import openai
import pytest
from modelfleet.dataplane.server.router import sticky_choice
from opentelemetry.trace import SpanKind

from .conftest import manifest_yaml


def scrape(fleet) -> str:
    return httpx.get(f"{fleet.url}/metrics").text


def metric_value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_concurrent_first_requests_load_once(fleet):
    client = openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
    assert fleet.dataplane.manager.slots[("lazy", "only")].state.value == "unloaded"
    answers = await asyncio.gather(
        *(client.completions.create(model="lazy", prompt=f"p{i}", max_tokens=2) for i in range(8))
    )
    assert all(a.choices for a in answers)
    assert (
        metric_value(scrape(fleet), "modelfleet_model_load_seconds_count", model="lazy", version="only")
        == 1.0
    )
    assert fleet.dataplane.manager.slots[("lazy", "only")].state.value == "loaded"


def test_load_failure_is_503_and_visible_while_others_serve(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="broken", prompt="x", max_tokens=1)
    assert info.value.status_code == 503
    assert "failed to load: FileNotFoundError" in info.value.body["message"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices
    versions = {(v["model"], v["version"]): v for v in httpx.get(f"{fleet.url}/ready").json()["versions"]}
    assert versions[("broken", "v1")]["state"] == "failed"
    assert "not a directory" in versions[("broken", "v1")]["error"]
    text = scrape(fleet)
    assert metric_value(text, "modelfleet_model_load_state", model="broken", state="failed") == 1.0
    assert metric_value(text, "modelfleet_model_load_failures_total", model="broken") >= 1.0


async def wait_for_weights(fleet, weights: tuple[int, int]) -> None:
    deadline = time.monotonic() + 10
    while fleet.dataplane.tables["tiny"].weights != weights:
        assert time.monotonic() < deadline, "the manifest change was not applied"
        await asyncio.sleep(0.02)


async def test_weight_change_while_streaming_has_zero_failures(fleet, tiny_model_dir, tiny_model_v2_dir):
    path = fleet.manifest_path
    original = path.read_text()
    client = openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
    versions_before, versions_after, failures = Counter(), Counter(), []
    started = []

    async def one(i: int, seen: Counter, max_tokens: int) -> None:
        try:
            raw = await client.completions.with_raw_response.create(
                model="tiny",
                prompt=f"stream {i}",
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            seen[raw.headers["x-modelfleet-version"]] += 1
            stream = raw.parse()
            if inspect.isawaitable(stream):
                stream = await stream
            chunks = []
            async for chunk in stream:
                if not chunks:
                    started.append(i)
                chunks.append(chunk)
            assert chunks[-1].choices[0].finish_reason == "length"
            assert sum(len(c.choices) for c in chunks) >= 1
        except Exception as exc:
            failures.append(exc)

    def write(w1: int, w2: int) -> None:
        path.write_text(
            manifest_yaml(tiny_model_dir, tiny_model_v2_dir, w1=w1, w2=w2, extra=fleet.extra_manifest)
        )

    try:
        write(100, 0)
        await wait_for_weights(fleet, (100, 0))
        in_flight = [asyncio.create_task(one(i, versions_before, 200)) for i in range(12)]
        while len(started) < 12:  # every one of them is streaming
            assert not failures, failures
            await asyncio.sleep(0.01)
        write(0, 100)  # the change lands while those 12 stream
        await wait_for_weights(fleet, (0, 100))
        still_streaming = sum(not t.done() for t in in_flight)
        after = [asyncio.create_task(one(i, versions_after, 8)) for i in range(12)]
        await asyncio.gather(*in_flight, *after)
    finally:
        path.write_text(original)
        await wait_for_weights(fleet, (50, 50))
    assert failures == []
    assert still_streaming > 0
    assert versions_before == {"v1": 12}
    assert versions_after == {"v2": 12}
    assert metric_value(scrape(fleet), "modelfleet_manifest_reloads_total", result="applied") >= 2


def test_invalid_manifest_change_keeps_serving(fleet):
    path = fleet.manifest_path
    original = path.read_text()
    try:
        path.write_text(original.replace("weight: 50", "weight: 70", 1))  # sums to 120
        time.sleep(0.4)
        assert metric_value(scrape(fleet), "modelfleet_manifest_reloads_total", result="invalid") >= 1
        served = httpx.post(
            f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60
        )
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 1
        # The last good split (50/50) still routes: the rejected 70/50 never replaced it.
        assert fleet.dataplane.tables["tiny"].weights == (50, 50)
    finally:
        path.write_text(original)
        deadline = time.monotonic() + 10
        while not metric_value(scrape(fleet), "modelfleet_manifest_reloads_total", result="applied"):
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(fleet):
    engine = fleet.engine("tiny", "v1")
    start = engine.stats()
    assert start.num_running == 0
    body = {"model": "tiny@v1", "prompt": "go on", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in received)
        assert engine.stats().num_running == 1
    # The connection is closed: the request must be aborted long before 480 tokens.
    deadline = time.monotonic() + 10
    while engine.stats().num_free_blocks != start.num_free_blocks or engine.stats().num_running:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.02)
    text = scrape(fleet)
    assert metric_value(text, "modelfleet_requests_total", model="tiny", version="v1", status="499") >= 1


def test_disconnect_while_waiting_for_a_plain_answer_aborts_it(fleet):
    engine = fleet.engine("tiny", "v2")
    start = engine.stats()
    before = scrape(fleet)
    gone_before = metric_value(before, "modelfleet_requests_total", model="tiny", version="v2", status="499")
    tokens_before = metric_value(before, "modelfleet_generation_tokens_total", model="tiny", version="v2")
    body = {"model": "tiny@v2", "prompt": "go on", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while engine.stats().num_free_blocks != start.num_free_blocks or engine.stats().num_running:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.02)
    text = scrape(fleet)
    assert (
        metric_value(text, "modelfleet_requests_total", model="tiny", version="v2", status="499")
        > gone_before
    )
    tokens = (
        metric_value(text, "modelfleet_generation_tokens_total", model="tiny", version="v2") - tokens_before
    )
    assert tokens < 480  # aborted, not run to the end


def test_span_tree_continues_the_client_trace(fleet):
    fleet.exporter.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    body = {
        "model": "tiny@v2",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", json=body, headers=headers) as response:
        response.read()
    deadline = time.monotonic() + 5  # the root span ends just after the last byte is sent
    while not any(s.name.startswith("POST") for s in fleet.exporter.get_finished_spans()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    spans = {s.name: s for s in fleet.exporter.get_finished_spans()}
    http = spans["POST /v1/chat/completions"]
    assert http.kind == SpanKind.SERVER
    assert format(http.context.trace_id, "032x") == trace_id
    assert format(http.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert http.attributes["http.response.status_code"] == 200
    assert http.attributes["modelfleet.version"] == "v2"
    inference = spans["chat tiny"]
    assert inference.parent.span_id == http.context.span_id
    attrs = inference.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "tiny@v2"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["modelfleet.version"] == "v2"
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert 1 <= attrs["gen_ai.usage.output_tokens"] <= 4
    assert attrs["gen_ai.response.finish_reasons"] in (("length",), ("stop",))
    for name in ("route", "queue", "prefill", "decode"):
        assert spans[name].parent.span_id == inference.context.span_id, name
        assert spans[name].context.trace_id == http.context.trace_id
    assert spans["prefill"].end_time <= spans["decode"].start_time


def test_one_server_span_a_request_with_a_global_provider_set(fleet, monkeypatch):
    """Where the process has a global tracer provider (as `opentelemetry-instrument` sets one), the
    request's server span is still ours alone: FastAPI's own telemetry, which would add a second span
    and its own metrics, is off."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    global_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(global_spans))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    fleet.exporter.clear()
    body = {"model": "tiny@v2", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 5
    while not any(s.name.startswith("POST") for s in fleet.exporter.get_finished_spans()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    servers = [s for s in fleet.exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [s.name for s in servers] == ["POST /v1/completions"]
    assert global_spans.get_finished_spans() == ()


def test_metrics_names(fleet):
    httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny@v1", "prompt": "x", "max_tokens": 3})
    text = scrape(fleet)
    for name in (
        "modelfleet_requests_total",
        "modelfleet_time_to_first_token_seconds_bucket",
        "modelfleet_inter_token_latency_seconds_bucket",
        "modelfleet_e2e_request_latency_seconds_bucket",
        "modelfleet_prompt_tokens_total",
        "modelfleet_generation_tokens_total",
        "modelfleet_num_requests_running",
        "modelfleet_num_requests_waiting",
        "modelfleet_kv_cache_usage_ratio",
        "modelfleet_prefix_cache_hit_ratio",
        "modelfleet_model_load_seconds_bucket",
        "modelfleet_model_load_state",
    ):
        assert f"\n{name}{{" in text, name
    assert metric_value(text, "modelfleet_requests_total", model="tiny", version="v1", status="200") >= 1
    assert metric_value(text, "modelfleet_generation_tokens_total", model="tiny", version="v1") >= 1


def test_sticky_user_keeps_its_version(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
    seen = {}
    for user in ("alice", "bob", "carol", "dave"):
        versions = {
            client.completions.with_raw_response.create(
                model="tiny", prompt="x", max_tokens=1, user=user
            ).headers["x-modelfleet-version"]
            for _ in range(5)
        }
        assert len(versions) == 1, (user, versions)
        seen[user] = versions.pop()
    # Each user lands where the router's rendezvous hash puts it, and the four spread over both versions.
    table = fleet.dataplane.tables["tiny"]
    assert seen == {user: sticky_choice(table, user) for user in seen}
    assert set(seen.values()) == {"v1", "v2"}


def test_shadow_copies_are_run_and_recorded_apart(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
    for _ in range(3):
        raw = client.completions.with_raw_response.create(model="shadowed", prompt="x", max_tokens=2)
        assert raw.headers["x-modelfleet-version"] == "a"
    deadline = time.monotonic() + 30
    while metric_value(scrape(fleet), "modelfleet_shadow_requests_total", version="b", status="ok") < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    text = scrape(fleet)
    assert metric_value(text, "modelfleet_requests_total", model="shadowed", version="b", status="200") == 0
    assert metric_value(text, "modelfleet_shadow_e2e_request_latency_seconds_count", version="b") >= 3
