"""The host side of a step: requests no one streams build no per-step outputs yet end exactly like
streamed ones; block tables are padded rows of each sequence's block ids."""

from __future__ import annotations

import numpy as np
import pytest
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.model_runner import _block_tables

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device="cpu")


def run(llm: LLM, requests: dict[str, tuple], *, stream: bool) -> dict[str, list]:
    for request_id, (prompt, params) in requests.items():
        llm.engine.add_request(request_id, prompt, params, stream=stream)
    outputs: dict[str, list] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_unstreamed_requests_give_one_output_equal_to_the_streamed_end(llm):
    full = llm.generate("Once upon a time", SamplingParams(max_tokens=20, **GREEDY))[0].text
    stop = full[8:11]
    assert stop
    requests = {
        "plain": ("Once upon a time", SamplingParams(max_tokens=20, **GREEDY)),
        "stop": ("Once upon a time", SamplingParams(max_tokens=20, stop=[stop], **GREEDY)),
        "logprobs": ([5, 6, 7], SamplingParams(max_tokens=9, logprobs=2, **GREEDY)),
    }
    streamed = run(llm, {f"s-{k}": v for k, v in requests.items()}, stream=True)
    unstreamed = run(llm, {f"u-{k}": v for k, v in requests.items()}, stream=False)
    for name in requests:
        outs, (final,) = streamed[f"s-{name}"], unstreamed[f"u-{name}"]
        assert len(outs) > 1 and final.finished
        last = outs[-1]
        for field in ("text", "token_ids", "logprobs", "finish_reason", "prompt_token_ids"):
            assert getattr(final, field) == getattr(last, field), (name, field)
        # One output: it carries everything as new.
        assert final.new_text == final.text and final.new_token_ids == final.token_ids
    assert unstreamed["u-stop"][0].finish_reason == "stop"
    assert unstreamed["u-stop"][0].text == full[: full.find(stop)]
    assert len(unstreamed["u-logprobs"][0].logprobs) == 9


def test_aborting_an_unstreamed_request_returns_its_text_so_far(llm):
    llm.engine.add_request("a", "The model server", SamplingParams(max_tokens=50, **GREEDY), stream=False)
    for _ in range(6):
        assert llm.step() == []
    out = llm.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert 1 <= len(out.token_ids) <= 6
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.new_token_ids == out.token_ids and out.new_text == out.text
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


@pytest.mark.parametrize("lengths", [[1], [3, 1, 4, 1, 5], [0, 2], [7] * 9])
def test_block_tables_are_zero_padded_rows(lengths):
    rng = np.random.default_rng(0)
    lists = [rng.integers(1, 1000, size=n).tolist() for n in lengths]
    table = _block_tables(lists)
    assert table.dtype == np.int32 and table.shape == (len(lists), max(lengths))
    for row, ids in zip(table, lists, strict=True):
        assert row[: len(ids)].tolist() == ids and not row[len(ids) :].any()
