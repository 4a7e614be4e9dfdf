"""Incremental detokenization and stop strings for one request.

Decoding only the newest tokens with a few tokens of context keeps the cost per step constant, and a
token that ends inside a multi-byte character (decoded as U+FFFD) waits for the next one. Text that
could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from typing import Any

# Tokens of context decoded before the new ones, so that spacing between words comes out right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self._decode = _fast_decode(tokenizer)
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        # All text decoded so far, and how much of it was handed out.
        self.text = ""
        self.num_emitted_chars = 0
        self._last_delta = ""

    def add_tokens(self, new_token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop string was found)."""
        if self.tokenizer is None:
            return "", False
        self.token_ids.extend(new_token_ids)
        self.text += self._decode_new(flush=finished)
        stopped = False
        if self.stop:
            stopped = self._truncate_at_stop(len(self.text) - len(self._last_delta))
        end = len(self.text) if (finished or stopped) else max(len(self.text) - self.hold_back, 0)
        end = max(end, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta, stopped

    def _decode_new(self, flush: bool) -> str:
        decode = self._decode
        before = decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        after = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
        self._last_delta = ""
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            self._last_delta = after[len(before) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
        return self._last_delta

    def _truncate_at_stop(self, new_from: int) -> bool:
        for stop in self.stop:
            # A stop string can only end inside the newly decoded text.
            index = self.text.find(stop, max(new_from - len(stop) + 1, 0))
            if index != -1:
                self.text = self.text[:index]
                return True
        return False


def _fast_decode(tokenizer: Any) -> Any:
    """The Rust tokenizer's own decode where it gives the same text as the Python wrapper's (which
    costs several times more per call for its argument checks): a fast tokenizer with no clean-up of
    tokenization spaces. Otherwise the wrapper's decode."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is not None
        and hasattr(backend, "decode")
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    ):
        return backend.decode
    return getattr(tokenizer, "decode", None)
