"""The gRPC API on a live server (real engine, tiny demo models): the same requests as HTTP, through the
same facade, with a real grpcio client."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import httpx
import pytest
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.server.auth import hash_key
from modelfleet.dataplane.server.grpc import proto
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import LiveServer, manifest_yaml

pb = proto.load()
KEY = (("authorization", "Bearer sk-grpc"),)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_model_v2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpc")
    keys = folder / "keys.json"
    keys.write_text(
        json.dumps(
            [
                {"sha256": hash_key("sk-grpc"), "name": "svc"},
                {"sha256": hash_key("sk-one"), "name": "one", "max_concurrent": 1},
            ]
        )
    )
    manifest = ServingManifest.from_yaml(manifest_yaml(tiny_model_dir, tiny_model_v2_dir, w1=100, w2=0))
    settings = ServerSettings(host="127.0.0.1", grpc_port=free_port(), api_key_file=keys)
    live = LiveServer(settings, manifest).start()
    live.wait_ready()
    live.channel = grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
    yield live
    live.channel.close()
    live.stop()


def rpc(server, name: str):
    channel = server.channel
    if name == "Generate":
        return channel.unary_stream(
            "/modelfleet.v1.Inference/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateChunk.FromString,
        )
    request = pb.CompletionRequest if name == "Completion" else pb.ChatRequest
    return channel.unary_unary(
        f"/modelfleet.v1.Inference/{name}",
        request_serializer=request.SerializeToString,
        response_deserializer=pb.Answer.FromString,
    )


def greedy(model: str = "tiny", max_tokens: int = 8, **extra):
    sampling = pb.Sampling(max_tokens=max_tokens, temperature=0.0)
    return pb.CompletionRequest(model=model, prompt="Once upon a time", sampling=sampling, **extra)


def test_streamed_generate_matches_the_http_completion(server):
    call = rpc(server, "Generate")(pb.GenerateRequest(completion=greedy("tiny@v1")), metadata=KEY)
    chunks = list(call)
    text = "".join(c.text for chunk in chunks for c in chunk.choices)
    body = {"model": "tiny@v1", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0}
    http = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"authorization": "Bearer sk-grpc"}, timeout=60
    ).json()
    assert text == http["choices"][0]["text"] and text
    assert chunks[-1].usage.completion_tokens == http["usage"]["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert dict(call.trailing_metadata())["x-modelfleet-version"] == "v1"


def test_pinning_v2_answers_from_v2_despite_its_zero_weight(server):
    answer, call = rpc(server, "Completion").with_call(greedy("tiny@v2"), metadata=KEY)
    assert dict(call.trailing_metadata())["x-modelfleet-version"] == "v2"
    assert answer.model == "tiny@v2" and answer.choices[0].text
    _, call = rpc(server, "Completion").with_call(greedy(), metadata=KEY)
    assert dict(call.trailing_metadata())["x-modelfleet-version"] == "v1"  # weights 100/0


def test_chat_runs_the_chat_template(server):
    request = pb.ChatRequest(
        model="tiny",
        messages=[pb.ChatMessage(role="user", content="hi")],
        sampling=pb.Sampling(max_tokens=4, temperature=0.0),
    )
    answer = rpc(server, "Chat")(request, metadata=KEY)
    assert json.loads(answer.openai_json)["object"] == "chat.completion"
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens > 0


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer sk-wrong"),)])
def test_no_or_wrong_key_is_unauthenticated(server, metadata):
    with pytest.raises(grpc.RpcError) as info:
        rpc(server, "Completion")(greedy(), metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in info.value.details()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'modelfleet_requests_total{model="_unknown",status="401",version=""}' in metrics


def test_unknown_model_is_not_found_with_the_http_message(server):
    with pytest.raises(grpc.RpcError) as info:
        list(rpc(server, "Generate")(pb.GenerateRequest(completion=greedy("nope")), metadata=KEY))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    http = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "nope", "prompt": "x"},
        headers={"authorization": "Bearer sk-grpc"},
    )
    assert info.value.details() == http.json()["error"]["message"]


def test_bad_fields_are_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as info:
        rpc(server, "Completion")(greedy(extra_json='{"best_of": 2}'), metadata=KEY)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "best_of: is not supported by this server; remove it"
    with pytest.raises(grpc.RpcError) as info:
        list(rpc(server, "Generate")(pb.GenerateRequest(), metadata=KEY))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_cancelled_stream_frees_its_request(server):
    engine = server.engine("tiny", "v1")
    request = greedy("tiny@v1", max_tokens=400, extra_json='{"ignore_eos": true}')
    call = rpc(server, "Generate")(pb.GenerateRequest(completion=request), metadata=KEY)
    next(call)  # running
    next(call)
    assert engine.stats().num_running == 1
    call.cancel()
    assert wait_until(lambda: engine.stats().num_running == 0, 10), "the engine still runs the request"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'modelfleet_requests_total{model="tiny",status="499",version="v1"}' in metrics


def test_a_cancelled_unary_call_frees_its_request(server):
    engine = server.engine("tiny", "v1")
    request = greedy("tiny@v1", max_tokens=400, extra_json='{"ignore_eos": true}')
    future = rpc(server, "Completion").future(request, metadata=KEY)
    assert wait_until(lambda: engine.stats().num_running == 1, 10)
    future.cancel()
    assert wait_until(lambda: engine.stats().num_running == 0, 10), "the engine still runs the request"


def test_a_taken_port_is_a_clear_error(server):
    from modelfleet.dataplane.server.grpc.service import GrpcServer

    async def build() -> None:  # grpc.aio builds its server on the running loop, as the lifespan does
        GrpcServer(server.dataplane, "127.0.0.1", server.dataplane.settings.grpc_port)

    with pytest.raises(OSError, match="in use"):
        asyncio.run(build())


def test_over_a_keys_limit_is_resource_exhausted_with_retry_after(server):
    one = (("authorization", "Bearer sk-one"),)
    request = greedy("tiny@v1", max_tokens=400, extra_json='{"ignore_eos": true}')
    stream = rpc(server, "Generate")(pb.GenerateRequest(completion=request), metadata=one)
    try:
        next(stream)
        with pytest.raises(grpc.RpcError) as info:
            rpc(server, "Completion")(greedy(), metadata=one)
    finally:
        stream.cancel()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests in flight (limit 1)" in info.value.details()
    assert dict(info.value.trailing_metadata())["retry-after"] == "1"


def test_requests_are_counted_and_traced_like_http(server):
    server.exporter.clear()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    rpc(server, "Completion")(greedy("tiny@v1"), metadata=(*KEY, ("traceparent", parent)))
    spans = {s.name: s for s in server.exporter.get_finished_spans()}
    root = spans["modelfleet.v1.Inference/Completion"]
    assert format(root.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert spans["text_completion tiny"].parent.span_id == root.context.span_id
    assert {"route", "queue", "prefill", "decode"} <= set(spans)
    assert root.attributes["modelfleet.version"] == "v1"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'modelfleet_requests_total{model="tiny",status="200",version="v1"}' in metrics
