"""Incremental detokenization and stop strings for one request.

Only the newest tokens are decoded, with a few tokens of context, so the cost per step stays constant,
and a token that ends inside a multi-byte character waits for the one that completes it. A fast
tokenizer streams through its library's public `DecodeStream`; a tokenizer without a Rust backend, or
one whose `decode` cleans up spaces afterwards (which no stream can do), decodes a sliding window with
its own `decode`. Text that could be the start of a stop string is held back until it is known not to
be one.

A streamed request's text can also be decoded elsewhere, where it is written: `handover` gives the tokens
a `StreamDecoder` there starts from (a stream relay: engine/stream_relay.py), and this one stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

# Tokens of context decoded before the new ones, so that spacing between words comes out right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str]) -> None:
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._decoder = None if tokenizer is None else _decoder(tokenizer, context)
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        # With stop strings: all text decoded so far, and how much of it was handed out.
        self.text = ""
        self.num_emitted_chars = 0

    def handover(self, token_ids: list[int]) -> Handover | None:
        """For a `StreamDecoder` elsewhere to go on from here, given every token fed so far with the
        prompt before them: a few tokens of context, and those held back inside an unfinished
        character. None where the text must stay here: stop strings need it each step, and only a
        stream decoder's text is the same wherever it is decoded."""
        if self.stop or not isinstance(self._decoder, StreamDecoder):
            return None
        held = self._decoder.held
        decoded = len(token_ids) - len(held)
        return Handover(token_ids[max(decoded - _CONTEXT_TOKENS, 0) : decoded], list(held))

    def add_tokens(self, new_token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop string was found)."""
        if self._decoder is None:
            return "", False
        new_text = self._decoder.add(new_token_ids, flush=finished)
        if not self.stop:  # nothing to search or hold back: the new text is the delta (the text is not kept)
            return new_text, False
        self.text += new_text
        stopped = self._truncate_at_stop(len(self.text) - len(new_text))
        end = len(self.text) if (finished or stopped) else max(len(self.text) - self.hold_back, 0)
        end = max(end, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta, stopped

    def _truncate_at_stop(self, new_from: int) -> bool:
        for stop in self.stop:
            # A stop string can only end inside the newly decoded text.
            index = self.text.find(stop, max(new_from - len(stop) + 1, 0))
            if index != -1:
                self.text = self.text[:index]
                return True
        return False


class Handover(NamedTuple):
    """Where a StreamDecoder elsewhere starts: tokens of context (decoded already), then tokens fed
    but held back inside an unfinished character (to feed it first)."""

    context: list[int]
    held: list[int]


def stream_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer a `StreamDecoder` decodes this tokenizer's text with, or None where it cannot
    (no Rust backend, or a `decode` that cleans up spaces afterwards, which no stream can do)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend
    return None


def _decoder(tokenizer: Any, context: list[int]) -> StreamDecoder | _WindowDecoder:
    backend = stream_backend(tokenizer)
    return _WindowDecoder(tokenizer, context) if backend is None else StreamDecoder(backend, context)


class StreamDecoder:
    """The Rust tokenizer's `DecodeStream`: its text is what `decode` of all the tokens gives."""

    def __init__(self, backend: Any, context: list[int], held: Sequence[int] = ()) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(context, skip_special_tokens=True)
        # Tokens the stream holds back (an unfinished character), for the flush at the end.
        self.held: list[int] = []
        if held:
            self.add(list(held), flush=False)

    def add(self, token_ids: list[int], flush: bool) -> str:
        text = self._stream.step(self._backend, token_ids) if token_ids else None
        if text is not None:
            self.held.clear()
            return text
        self.held.extend(token_ids)
        if flush and self.held:  # the request ends inside a character: its bytes decode as U+FFFD
            text = self._backend.decode(self.held, skip_special_tokens=True)
            self.held.clear()
            return text
        return ""


class _WindowDecoder:
    """Decodes the newest tokens after a few of context through the tokenizer's own `decode`, keeping
    the text that the new tokens add."""

    def __init__(self, tokenizer: Any, context: list[int]) -> None:
        self._decode = tokenizer.decode
        self.token_ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def add(self, token_ids: list[int], flush: bool) -> str:
        self.token_ids.extend(token_ids)
        decode = self._decode
        before = decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        after = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return after[len(before) :]
        return ""
