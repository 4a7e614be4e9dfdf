"""A chat request without max_tokens may use the rest of the context, but never more than its key's
token rate allows: it runs with what fits, rather than a 429 for a length the client never asked for."""

from __future__ import annotations

import json

import openai
import pytest
from modelfleet.dataplane.manifest import single_model_manifest
from modelfleet.dataplane.server.auth import hash_key
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import TEST_ENGINE, LiveServer

BUDGET = 60


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps([{"sha256": hash_key("sk-small"), "name": "small", "tokens_per_minute": BUDGET}])
    )
    manifest = single_model_manifest(tiny_model_dir, name="tiny")
    manifest.models[0].engine.update(TEST_ENGINE)
    live = LiveServer(ServerSettings(api_key_file=keys), manifest).start()
    live.wait_ready()
    yield live
    live.stop()


def test_the_default_fits_the_key_budget(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-small", max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == BUDGET  # the whole minute's budget, not the model's context
    # and it was charged: the minute's budget is spent
    with pytest.raises(openai.RateLimitError, match="over its limit of 60 tokens per minute"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
