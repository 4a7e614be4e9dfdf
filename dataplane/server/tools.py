"""Tool calls in a model's text, in the two formats chat templates teach models:

- Hermes (Qwen 2.5+, Hermes, many fine-tunes): content, then `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks.
- Llama 3.1+ JSON: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  optionally after `<|python_tag|>`.

Both are tried on every answer, so no per-model setting is needed. A call naming a tool the request did
not offer, or with arguments that are not a JSON object, is not a call: the text stays content, as the
model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.S)
# What may start a call: held back from a stream until the answer shows whether it is one.
_MARKERS = (HERMES_OPEN, PYTHON_TAG)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: object, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]] | None:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    calls = []
    for block in _HERMES_BLOCK.findall(text, start):
        try:
            call = _call(json.loads(block), names)
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return (text[:start].strip() or None), calls


def parse_llama_json(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]] | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        call = _call(obj, names)
        if call is None:
            return None
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):  # Llama's separator between calls
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
    return None, calls


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; no calls: the text is all content."""
    for parse in (parse_hermes, parse_llama_json):
        found = parse(text, names)
        if found is not None and found[1]:
            return found
    return text, []


def parse_forced(text: str, forced: str, names: set[str]) -> list[ToolCall]:
    """The calls of an answer decoded under a forced tool_choice (a grammar made it JSON): for a named
    function, its arguments object; for "required" ('*'), a list of {"name", "parameters"}. Nothing
    when the JSON is cut short (max_tokens): the text then stays content."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if forced != "*":
        call = _call({"name": forced, "arguments": value}, names)
        return [call] if call else []
    if not isinstance(value, list):
        return []
    calls = [_call(item, names) for item in value]
    return [c for c in calls if c is not None] if all(calls) else []


class ToolStream:
    """A streamed answer split into content that can go out now, and text held back because it may be
    the start of a tool call (decided when the answer ends)."""

    def __init__(self, names: set[str], forced: str | None = None) -> None:
        self.names = names
        self.forced = forced  # a forced tool_choice: the whole answer is the calls' JSON
        self.held = ""
        self.sent_any = False
        self.in_call = forced is not None

    def feed(self, text: str) -> str:
        """The part of the new text that is content for sure."""
        self.held += text
        if self.in_call:
            return ""
        if not self.sent_any:
            stripped = self.held.lstrip()
            if stripped.startswith(("{", *_MARKERS)):  # a Llama JSON call, or a marker: hold it all
                self.in_call = True
                return ""
            if not stripped or any(m.startswith(stripped) for m in _MARKERS):
                return ""  # too short to tell yet
        at = min((i for i in (self.held.find(m) for m in _MARKERS) if i >= 0), default=-1)
        if at >= 0:
            out, self.held, self.in_call = self.held[:at], self.held[at:], True
        else:
            keep = _partial_marker_suffix(self.held)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent_any = self.sent_any or bool(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the answer's end: the content still to send, and the calls."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        if self.forced is not None:
            calls = parse_forced(held, self.forced, self.names)
            return ("", calls) if calls else (held, [])
        content, calls = parse_tool_calls(held, self.names)
        if not calls:
            return held, []
        return content or "", calls


def _partial_marker_suffix(text: str) -> int:
    """Length of the longest end of `text` that begins a marker (held until the next text decides)."""
    for size in range(min(len(text), max(map(len, _MARKERS))), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in _MARKERS):
            return size
    return 0
