"""Incremental detokenization: deltas add up to the full decode; stop strings are cut and held back."""

from __future__ import annotations

import pytest
from modelfleet.dataplane.engine.detokenizer import IncrementalDetokenizer, StreamDecoder, stream_backend


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


def test_a_stream_handed_over_anywhere_decodes_on_elsewhere_to_the_same_text(tokenizer):
    """A stream relay goes on decoding from a handover: at every split, even inside a character, the
    text out of both ends is the engine's own, with the tokenizer's JSON alone on the far side."""
    from tokenizers import Tokenizer

    prompt = tokenizer.encode("x")
    output = tokenizer.encode(" naïve 😀 é, then more words!", add_special_tokens=False)
    whole = "".join(d for d, _ in feed(IncrementalDetokenizer(tokenizer, prompt, []), output))
    assert whole == tokenizer.decode(output, skip_special_tokens=True)
    backend = Tokenizer.from_str(stream_backend(tokenizer).to_str())  # what a relay rebuilds
    splits_inside_a_character = 0
    for split in range(1, len(output)):
        here = IncrementalDetokenizer(tokenizer, prompt, [])
        text = "".join(here.add_tokens([t], finished=False)[0] for t in output[:split])
        handover = here.handover(prompt + output[:split])
        assert handover is not None and len(handover.context) <= 5
        splits_inside_a_character += bool(handover.held)
        there = StreamDecoder(backend, handover.context, handover.held)
        text += "".join(
            there.add([t], flush=i == len(output) - 1) for i, t in enumerate(output) if i >= split
        )
        assert text == whole, split
    assert splits_inside_a_character  # the emoji's bytes span tokens: some splits fall inside it


def test_text_with_stop_strings_or_without_a_stream_decoder_stays(tokenizer, monkeypatch):
    prompt = tokenizer.encode("x")
    assert IncrementalDetokenizer(tokenizer, prompt, ["STOP"]).handover(prompt) is None
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", None)  # the window decoder
    assert stream_backend(tokenizer) is None
    assert IncrementalDetokenizer(tokenizer, prompt, []).handover(prompt) is None
