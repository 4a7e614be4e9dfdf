"""The DataPlane facade without HTTP, over a scripted engine: the paths a real tiny model cannot be made
to take on demand (an engine failure inside one request) and the fan-out of `n`."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.engine.protocol import EngineLimits
from modelfleet.dataplane.manifest import single_model_manifest
from modelfleet.dataplane.server.app import create_app
from modelfleet.dataplane.server.auth import ANONYMOUS
from modelfleet.dataplane.server.dataplane import DataPlane, RequestContext
from modelfleet.dataplane.server.errors import BadRequest, EngineFailure, RateLimited
from modelfleet.dataplane.server.protocol import CompletionRequest
from modelfleet.dataplane.server.runtime import build_dataplane
from modelfleet.dataplane.server.settings import ServerSettings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

POISON = 13  # a prompt holding this token fails inside the scripted engine after two tokens


class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def __len__(self) -> int:
        return 50

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **extra) -> list[int]:
        return self.encode("".join(f"{m['role']}:{m['content']};" for m in messages))


class ScriptedEngine:
    """Emits one token per step; records the parameters it was given."""

    limits = EngineLimits(max_num_seqs=64, max_model_len=64, vocab_size=50)
    failure: str | None = None
    on_failure = None

    def __init__(self) -> None:
        self.tokenizer = Tokenizer()
        self.seen_seeds: list[int | None] = []

    async def generate(self, prompt, params, request_id=None, priority=0):
        self.seen_seeds.append(params.seed)
        ids: list[int] = []
        for step in range(params.max_tokens):
            await asyncio.sleep(0.001)
            if POISON in prompt and step == 2:
                yield RequestOutput(
                    request_id, prompt, finish_reason="error", finished=True, error="NaN logits"
                )
                return
            token = (len(prompt) + step) % 50
            ids.append(token)
            last = step == params.max_tokens - 1
            yield RequestOutput(
                request_id,
                prompt,
                token_ids=list(ids),
                new_token_ids=[token],
                new_text=self.tokenizer.decode([token]),
                finish_reason="length" if last else None,
                finished=last,
            )

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0.0, 100, 100)

    def close(self) -> None:
        pass


@pytest.fixture
async def dataplane():
    engine = ScriptedEngine()
    dp = build_dataplane(ServerSettings(), loader=lambda spec: engine, estimate_bytes=lambda spec: 0)
    dp.apply_manifest(single_model_manifest("/models/m", name="m"))
    dp.engine = engine
    yield dp
    await dp.close()


def ctx() -> RequestContext:
    return RequestContext(principal=ANONYMOUS)


async def test_engine_failure_fails_only_that_request(dataplane):
    bad = await dataplane.completion(CompletionRequest(model="m", prompt=[1, POISON], max_tokens=5), ctx())
    good = await dataplane.completion(CompletionRequest(model="m", prompt=[1, 2], max_tokens=5), ctx())
    results = await asyncio.gather(bad.response(), good.response(), return_exceptions=True)
    assert isinstance(results[0], EngineFailure)
    assert results[0].status == 500 and "NaN logits" in results[0].message
    assert results[1].choices[0].finish_reason == "length"
    assert results[1].usage.completion_tokens == 5
    text = dataplane.metrics.render().decode()
    assert 'modelfleet_requests_total{model="m",status="500",version="v1"} 1.0' in text
    assert 'modelfleet_requests_total{model="m",status="200",version="v1"} 1.0' in text
    assert dataplane.manager.slots[("m", "v1")].in_flight == 0  # the lease was released either way


async def test_n_fans_out_with_distinct_seeds(dataplane):
    request = CompletionRequest(model="m", prompt=["ab", "cde"], max_tokens=3, n=2, seed=10)
    answer = await (await dataplane.completion(request, ctx())).response()
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert sorted(dataplane.engine.seen_seeds) == [10, 10, 11, 11]
    assert answer.usage.prompt_tokens == (2 + 3) * 2
    assert answer.usage.completion_tokens == 12


async def test_failure_mid_stream_is_reported_in_the_stream(dataplane):
    app = create_app(dataplane)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        body = {"model": "m", "prompt": [1, POISON], "max_tokens": 5, "stream": True}
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200  # the first tokens went out before the failure
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and "NaN logits" in error["message"]
    assert len(events) == 4  # two token chunks, the error, [DONE]


@pytest.mark.parametrize(
    ("settings", "request_args", "prompt_len", "message"),
    [
        ({"max_prompt_tokens": 8}, {}, 9, "prompt: has 9 tokens, over the limit of 8 (max_prompt_tokens)"),
        ({}, {}, 64, "over the limit of 63 (the model's max_model_len - 1)"),
        ({"max_tokens_limit": 10}, {"max_tokens": 11}, 4, "max_tokens: 11 is over the server's limit of 10"),
        ({}, {"max_tokens": 61}, 4, "plus max_tokens (61) exceeds the model's context of 64 tokens"),
        ({"max_n": 2}, {"n": 3}, 4, "n: 3 is over the server's limit of 2"),
        ({"max_logprobs": 5}, {"logprobs": 6}, 4, "logprobs: 6 is over the server's limit of 5"),
        ({}, {"top_k": -5}, 4, "top_k: -5 must be -1 or 0"),
    ],
)
def test_request_limits_name_the_limit(settings, request_args, prompt_len, message):
    from modelfleet.dataplane.server.checks import check_request
    from modelfleet.dataplane.server.errors import BadRequest

    request = CompletionRequest(model="m", prompt="x", **request_args)
    with pytest.raises(BadRequest) as info:
        check_request(ServerSettings(**settings), request, [[1] * prompt_len], 64)
    assert message in info.value.message
    assert info.value.status == 400


# Each limit at its value passes and one past it is refused: a limit moved by one fails one of the two.
@pytest.mark.parametrize(
    ("settings", "at_limit", "one_past", "param"),
    [
        ({"max_prompt_tokens": 8}, (8, {}), (9, {}), "prompt"),
        ({}, (63, {}), (64, {}), "prompt"),  # max_model_len - 1
        ({"max_tokens_limit": 10}, (4, {"max_tokens": 10}), (4, {"max_tokens": 11}), "max_tokens"),
        # The prompt plus max_tokens up to max_model_len, moving either of the two.
        ({}, (4, {"max_tokens": 60}), (4, {"max_tokens": 61}), "max_tokens"),
        ({"max_prompt_tokens": 100}, (63, {"max_tokens": 1}), (64, {"max_tokens": 1}), "max_tokens"),
        ({"max_n": 2}, (4, {"n": 2}), (4, {"n": 3}), "n"),
        ({"max_logprobs": 5}, (4, {"logprobs": 5}), (4, {"logprobs": 6}), "logprobs"),
    ],
)
def test_request_limits_at_and_one_past_the_limit(settings, at_limit, one_past, param):
    from modelfleet.dataplane.server.checks import check_request
    from modelfleet.dataplane.server.errors import BadRequest

    server = ServerSettings(**settings)
    prompt_len, args = at_limit
    params = check_request(server, CompletionRequest(model="m", prompt="x", **args), [[1] * prompt_len], 64)
    assert params.max_tokens == args.get("max_tokens", server.default_max_tokens)
    assert params.logprobs == args.get("logprobs")
    prompt_len, args = one_past
    with pytest.raises(BadRequest) as info:
        check_request(server, CompletionRequest(model="m", prompt="x", **args), [[1] * prompt_len], 64)
    assert info.value.param == param
    assert info.value.status == 400


def test_an_empty_prompt_and_a_bad_sampling_parameter_are_400s_naming_the_field():
    from modelfleet.dataplane.server.checks import check_request

    for args, prompts, param in [({}, [[1], []], "prompt"), ({"top_k": -5}, [[1]], "top_k")]:
        with pytest.raises(BadRequest) as info:
            check_request(ServerSettings(), CompletionRequest(model="m", prompt="x", **args), prompts, 64)
        assert info.value.param == param


def test_without_a_known_context_length_only_the_servers_limits_apply():
    from modelfleet.dataplane.server.checks import check_prompt_chars, check_request

    class Vocab:
        def get_vocab(self) -> dict[str, int]:
            return {"abc": 0, "d": 1}

    request = CompletionRequest(model="m", prompt="x" * 5000, max_tokens=3)
    assert check_prompt_chars(ServerSettings(), request, Vocab(), None) == 5000
    assert check_request(ServerSettings(), request, [[1] * 500], None).max_tokens == 3


def test_the_longest_token_is_read_from_the_vocabulary_once():
    from modelfleet.dataplane.server.checks import longest_token_chars

    class Vocab:
        calls = 0

        def get_vocab(self) -> dict[str, int]:
            self.calls += 1
            return {"abcd": 0, "e": 1}

    tokenizer = Vocab()
    assert longest_token_chars(tokenizer) == 4
    assert longest_token_chars(tokenizer) == 4
    assert tokenizer.calls == 1


async def test_what_a_request_reserved_and_did_not_use_is_given_back(dataplane):
    """A request that fails after two tokens keeps only what it used of its reservation (its prompt and
    two tokens): the key's next request, which would not fit beside the whole reservation, runs."""
    from modelfleet.dataplane.server.auth import KeyLimits, Principal, RateLimiter

    dataplane.limiter = RateLimiter(clock=lambda: 1000.0)
    caller = RequestContext(principal=Principal("team", KeyLimits(tokens_per_minute=30)))
    failed = await dataplane.completion(
        CompletionRequest(model="m", prompt=[1, POISON], max_tokens=20), caller
    )
    with pytest.raises(EngineFailure):
        await failed.response()
    request = CompletionRequest(model="m", prompt=[1, 2], max_tokens=20)  # 22 of the 26 left
    answer = await (await dataplane.completion(request, caller)).response()
    assert answer.usage.completion_tokens == 20


async def test_prompt_tokens_are_charged_to_the_key(dataplane):
    """A long prompt with max_tokens=1 costs its prompt tokens too: 20 + 1 of a key's 30 tokens a minute
    leave 9, too few for a request of 9 + 1, which may run once the first leaves the window (60 s)."""
    from modelfleet.dataplane.server.auth import KeyLimits, Principal, RateLimiter
    from modelfleet.dataplane.server.errors import RateLimited

    now = [1000.0]
    dataplane.limiter = RateLimiter(clock=lambda: now[0])
    caller = RequestContext(principal=Principal("team", KeyLimits(tokens_per_minute=30)))
    request = CompletionRequest(model="m", prompt=[1] * 20, max_tokens=1)
    answer = await (await dataplane.completion(request, caller)).response()
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (20, 1)
    with pytest.raises(RateLimited) as info:
        await dataplane.completion(CompletionRequest(model="m", prompt=[1] * 9, max_tokens=1), caller)
    assert info.value.headers["Retry-After"] == "60"
    now[0] += 60  # the first request left the window: admitted again
    again = await (
        await dataplane.completion(CompletionRequest(model="m", prompt=[1], max_tokens=1), caller)
    ).response()
    assert again.usage.completion_tokens == 1


def sample(dp, name: str, **labels) -> float | None:
    return dp.metrics.registry.get_sample_value(name, labels)


async def test_refusals_are_counted_once_under_their_labels(dataplane):
    """An unknown model counts under `_unknown` (clients cannot grow the series), a known one under its
    name and version; each refusal once (the HTTP layer does not count it again); only limit refusals
    count as rejected."""
    from modelfleet.dataplane.server.auth import KeyLimits, Principal

    transport = httpx.ASGITransport(app=create_app(dataplane))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        missing = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        too_long = await http.post(
            "/v1/completions", json={"model": "m", "prompt": [1] * 64, "max_tokens": 1}
        )
    assert (missing.status_code, too_long.status_code) == (404, 400)
    total = "modelfleet_requests_total"
    assert sample(dataplane, total, model="_unknown", version="", status="404") == 1.0
    assert sample(dataplane, total, model="nope", version="", status="404") is None
    assert sample(dataplane, total, model="m", version="v1", status="400") == 1.0
    assert sample(dataplane, total, model="_unknown", version="v1", status="400") is None
    rejected = "modelfleet_rejected_requests_total"
    assert sample(dataplane, rejected, reason="model_not_found") is None
    assert sample(dataplane, rejected, reason="invalid_request_error") is None

    busy = RequestContext(principal=Principal("busy", KeyLimits(max_concurrent=1)))
    first = await dataplane.completion(CompletionRequest(model="m", prompt=[1], max_tokens=2), busy)
    with pytest.raises(RateLimited):
        await dataplane.completion(CompletionRequest(model="m", prompt=[1], max_tokens=2), busy)
    await first.response()
    assert sample(dataplane, rejected, reason="concurrency_limit_exceeded") == 1.0
    # The first request's place was given back when it ended.
    again = await dataplane.completion(CompletionRequest(model="m", prompt=[1], max_tokens=1), busy)
    assert (await again.response()).usage.completion_tokens == 1
    assert sample(dataplane, total, model="m", version="v1", status="429") == 1.0


async def test_an_unexpected_failure_before_admission_is_a_500(dataplane, monkeypatch):
    def broken(text: str) -> list[int]:
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(dataplane.engine.tokenizer, "encode", broken)
    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        await dataplane.completion(CompletionRequest(model="m", prompt="text", max_tokens=1), ctx())
    assert sample(dataplane, "modelfleet_requests_total", model="m", version="v1", status="500") == 1.0
    assert dataplane.manager.slots[("m", "v1")].in_flight == 0


async def test_a_request_waiting_for_admission_shows_in_the_queue_gauge():
    engine = ScriptedEngine()
    dp = build_dataplane(
        ServerSettings(max_running=1), loader=lambda spec: engine, estimate_bytes=lambda spec: 0
    )
    dp.apply_manifest(single_model_manifest("/models/m", name="m"))
    try:
        first = await dp.completion(CompletionRequest(model="m", prompt=[1], max_tokens=3), ctx())
        second = asyncio.create_task(
            dp.completion(CompletionRequest(model="m", prompt=[2], max_tokens=3), ctx())
        )
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done()
        assert sample(dp, "modelfleet_admission_queue_waiting") == 1.0
        await first.response()
        answer = await (await second).response()
        assert answer.usage.completion_tokens == 3
        assert sample(dp, "modelfleet_admission_queue_waiting") == 0.0
    finally:
        await dp.close()


async def test_shadow_versions_get_a_copy_of_each_request():
    from modelfleet.dataplane.manifest import ServingManifest

    engine = ScriptedEngine()
    dp = build_dataplane(ServerSettings(), loader=lambda spec: engine, estimate_bytes=lambda spec: 0)
    dp.apply_manifest(
        ServingManifest.from_yaml(
            """
models:
  - name: m
    versions:
      - {name: live, weight: 100, artifact: /models/a}
      - {name: dark, weight: 0, artifact: /models/b, shadow_percent: 100}
"""
        )
    )
    try:
        answer = await (
            await dp.completion(CompletionRequest(model="m", prompt=[1], max_tokens=2), ctx())
        ).response()
        assert answer.usage.completion_tokens == 2
        for _ in range(500):
            if sample(dp, "modelfleet_shadow_requests_total", model="m", version="dark", status="ok"):
                break
            await asyncio.sleep(0.01)
        assert sample(dp, "modelfleet_shadow_requests_total", model="m", version="dark", status="ok") == 1.0
        assert len(engine.seen_seeds) == 2  # the request and its copy
        total = "modelfleet_requests_total"
        assert sample(dp, total, model="m", version="live", status="200") == 1.0
        assert sample(dp, total, model="m", version="dark", status="200") is None
    finally:
        await dp.close()


def test_prompt_plus_max_tokens_is_checked_against_the_longest_prompt_of_a_batch():
    from modelfleet.dataplane.server.checks import check_request
    from modelfleet.dataplane.server.errors import BadRequest

    request = CompletionRequest(model="m", prompt=["short", "long"], max_tokens=5)
    assert check_request(ServerSettings(), request, [[1] * 4, [1] * 59], 64).max_tokens == 5
    with pytest.raises(BadRequest, match=r"the prompt \(60 tokens\) plus max_tokens \(5\)"):
        check_request(ServerSettings(), request, [[1] * 4, [1] * 60], 64)


def traced_dataplane() -> tuple[DataPlane, InMemorySpanExporter]:
    """A facade serving model `m` on a scripted engine, its finished spans kept by the exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = ScriptedEngine()
    dp = build_dataplane(
        ServerSettings(),
        tracer=provider.get_tracer("t"),
        loader=lambda spec: engine,
        estimate_bytes=lambda spec: 0,
    )
    dp.apply_manifest(single_model_manifest("/models/m", name="m"))
    return dp, exporter


async def test_a_refused_request_ends_its_span_with_the_error():
    from opentelemetry.trace import StatusCode

    dp, exporter = traced_dataplane()
    try:
        with pytest.raises(BadRequest):
            await dp.completion(CompletionRequest(model="m", prompt=[1] * 64, max_tokens=1), ctx())
    finally:
        await dp.close()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "text_completion m"]
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "context_length_exceeded"


def test_batch_and_prompt_text_limits_at_and_one_past_the_limit():
    from modelfleet.dataplane.server.checks import check_batch, check_prompt_chars, longest_token_chars

    settings = ServerSettings(max_batch_prompts=2)
    assert check_batch(settings, CompletionRequest(model="m", prompt=["a", "b"])) == 2
    assert check_batch(settings, CompletionRequest(model="m", prompt=[1, 2, 3])) == 1  # one prompt of ids
    with pytest.raises(BadRequest) as info:
        check_batch(settings, CompletionRequest(model="m", prompt=["a", "b", "c"]))
    assert info.value.param == "prompt"

    class Vocab:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "abc": 1}  # the longest token has 3 characters

    tokenizer = Vocab()
    bound = 63 * 3 * 4  # (max_model_len - 1) tokens x 3 characters x the normalizers' room
    assert (
        check_prompt_chars(ServerSettings(), CompletionRequest(model="m", prompt="x" * bound), tokenizer, 64)
        == bound
    )
    assert longest_token_chars(tokenizer) == 3 and tokenizer._modelfleet_longest_token == 3
    with pytest.raises(BadRequest) as info:
        check_prompt_chars(
            ServerSettings(), CompletionRequest(model="m", prompt="x" * (bound + 1)), tokenizer, 64
        )
    assert info.value.param == "prompt" and f"{bound + 1} characters" in info.value.message


async def test_a_request_whose_engine_died_while_it_waited_is_told_to_retry():
    from modelfleet.dataplane.server.errors import ModelUnavailable

    engine = ScriptedEngine()
    dp = build_dataplane(
        ServerSettings(max_running=1), loader=lambda spec: engine, estimate_bytes=lambda spec: 0
    )
    dp.apply_manifest(single_model_manifest("/models/m", name="m"))
    try:
        first = await dp.completion(CompletionRequest(model="m", prompt=[1], max_tokens=2), ctx())
        second = asyncio.create_task(
            dp.completion(CompletionRequest(model="m", prompt=[2], max_tokens=2), ctx())
        )
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done()
        dp.manager.slots[("m", "v1")].engine = None  # what unloading a dead engine leaves behind
        await first.response()
        with pytest.raises(ModelUnavailable) as info:
            await second
        assert info.value.code == "engine_restarting"
        assert info.value.headers["Retry-After"] == "1"
    finally:
        await dp.close()


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context_up_to_the_limit():
    from modelfleet.dataplane.server.checks import default_max_tokens
    from modelfleet.dataplane.server.protocol import ChatCompletionRequest

    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    settings = ServerSettings(max_tokens_limit=50)
    assert default_max_tokens(settings, chat, [[1] * 4, [1] * 30], 64) == 34  # room after the longest
    assert default_max_tokens(settings, chat, [[1] * 4], 64) == 50  # capped by max_tokens_limit
    assert default_max_tokens(settings, chat, [[1] * 64], 64) == 1  # never below one
    completion = CompletionRequest(model="m", prompt="x")
    assert default_max_tokens(settings, completion, [[1] * 4], 64) == settings.default_max_tokens


def test_chat_logprobs_without_top_logprobs_ask_for_the_chosen_token_only():
    from modelfleet.dataplane.server.checks import requested_logprobs
    from modelfleet.dataplane.server.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    assert requested_logprobs(ChatCompletionRequest(model="m", messages=messages, logprobs=True)) == 0
    assert (
        requested_logprobs(ChatCompletionRequest(model="m", messages=messages, logprobs=True, top_logprobs=3))
        == 3
    )
    assert requested_logprobs(ChatCompletionRequest(model="m", messages=messages)) is None


def test_a_default_max_tokens_shrinks_to_what_the_keys_token_rate_allows():
    from modelfleet.dataplane.sampling_params import SamplingParams
    from modelfleet.dataplane.server.checks import fit_default_max_tokens
    from modelfleet.dataplane.server.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]

    def fitted(request, prompts, tpm, default=500) -> int:
        params = SamplingParams(max_tokens=default)
        fit_default_max_tokens(request, params, prompts, tpm)
        return params.max_tokens

    chat = ChatCompletionRequest(model="m", messages=messages)
    assert fitted(chat, [[1] * 10], 100) == 90  # the rate's room after the prompt
    assert fitted(chat, [[1] * 10], 100, default=40) == 40  # a smaller default stays
    assert fitted(chat, [[1] * 10], 0) == 500  # no token rate: unchanged
    assert fitted(chat, [[1] * 120], 100) == 1  # never below one
    assert fitted(ChatCompletionRequest(model="m", messages=messages, n=2), [[1] * 10], 100) == 40
    asked = ChatCompletionRequest(model="m", messages=messages, max_tokens=300)
    assert fitted(asked, [[1] * 10], 100, default=300) == 300  # what the client asked for is kept


async def test_a_chat_without_max_tokens_runs_within_its_keys_token_rate(dataplane):
    from modelfleet.dataplane.server.auth import KeyLimits, Principal
    from modelfleet.dataplane.server.protocol import ChatCompletionRequest

    caller = RequestContext(principal=Principal("small", KeyLimits(tokens_per_minute=40)))
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    answer = await (await dataplane.chat(chat, caller)).response()
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 40
