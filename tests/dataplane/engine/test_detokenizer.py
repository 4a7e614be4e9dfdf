"""Incremental detokenization: deltas add up to the full decode; stop strings are cut and held back."""

from __future__ import annotations

import pytest
from modelfleet.dataplane.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[tuple[str, bool]]:
    return [detok.add_tokens([t], finished=i == len(token_ids) - 1) for i, t in enumerate(token_ids)]


def test_one_token_at_a_time_adds_up_to_the_full_decode(tokenizer):
    prompt = tokenizer.encode("The engine streams")
    output = tokenizer.encode(
        " text one token at a time, with spaces and punctuation!", add_special_tokens=False
    )
    deltas = feed(IncrementalDetokenizer(tokenizer, prompt, []), output)
    assert "".join(d for d, _ in deltas) == tokenizer.decode(output, skip_special_tokens=True)
    assert not any(stopped for _, stopped in deltas)


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    output = tokenizer.encode(" alpha beta STOP gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), ["STOP"])
    streamed = ""
    for i, token in enumerate(output):
        delta, stopped = detok.add_tokens([token], finished=i == len(output) - 1)
        streamed += delta
        assert "ST" not in streamed or stopped  # a possible stop prefix is held back
        if stopped:
            break
    assert stopped
    assert streamed == " alpha beta "


@pytest.mark.parametrize("window", [False, True], ids=["stream", "window"])
def test_multi_byte_characters_wait_for_their_last_token(tokenizer, window, monkeypatch):
    if window:  # a tokenizer whose decode cleans up spaces takes the sliding-window decode
        monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", None)
    output = tokenizer.encode(" naïve 😀 é!", add_special_tokens=False)
    deltas = feed(IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), []), output)
    assert len(output) > len(" naïve 😀 é!")  # some characters take several tokens
    assert "".join(d for d, _ in deltas) == " naïve 😀 é!"
    assert not any("\ufffd" in d for d, _ in deltas)


@pytest.mark.parametrize("window", [False, True], ids=["stream", "window"])
def test_a_request_ending_inside_a_character_flushes_its_bytes(tokenizer, window, monkeypatch):
    if window:
        monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", None)
    cut = tokenizer.encode(" ok 😀", add_special_tokens=False)[:-1]  # the emoji's last byte is missing
    deltas = feed(IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), []), cut)
    text = "".join(d for d, _ in deltas)
    assert text == tokenizer.decode(cut) and text.startswith(" ok ") and text.endswith("\ufffd")
