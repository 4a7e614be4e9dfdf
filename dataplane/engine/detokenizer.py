"""Incremental detokenization and stop strings for one request.

Only the newest tokens are decoded, with a few tokens of context, so the cost per step stays constant,
and a token that ends inside a multi-byte character waits for the one that completes it. A fast
tokenizer streams through its library's public `DecodeStream`; a tokenizer without a Rust backend, or
one whose `decode` cleans up spaces afterwards (which no stream can do), decodes a sliding window with
its own `decode`. Text that could be the start of a stop string is held back until it is known not to
be one.
"""

from __future__ import annotations

from typing import Any

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


def _decoder(tokenizer: Any, context: list[int]) -> _StreamDecoder | _WindowDecoder:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return _StreamDecoder(backend, context)
    return _WindowDecoder(tokenizer, context)


class _StreamDecoder:
    """The Rust tokenizer's `DecodeStream`: its text is what `decode` of all the tokens gives."""

    def __init__(self, backend: Any, context: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(context, skip_special_tokens=True)
        # Tokens the stream holds back (an unfinished character), for the flush at the end.
        self._pending: list[int] = []

    def add(self, token_ids: list[int], flush: bool) -> str:
        text = self._stream.step(self._backend, token_ids) if token_ids else None
        if text is not None:
            self._pending.clear()
            return text
        self._pending.extend(token_ids)
        if flush and self._pending:  # the request ends inside a character: its bytes decode as U+FFFD
            text = self._backend.decode(self._pending, skip_special_tokens=True)
            self._pending.clear()
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
