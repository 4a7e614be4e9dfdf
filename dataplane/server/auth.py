"""API keys and per-key limits.

The key file holds sha256 hex digests, never keys: either one digest per line (`#` comments allowed),
or JSON: a list of `{"sha256": ..., "name": ..., "tokens_per_minute": ..., "max_concurrent": ...}`
objects (or a mapping digest -> that object). No file means an open server.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from modelfleet.dataplane.server.errors import RateLimited, Unauthorized

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class KeyFileError(ValueError):
    """The key file cannot be used; one line naming the file, the entry and the fix."""


@dataclass(frozen=True)
class KeyLimits:
    tokens_per_minute: int = 0  # 0 = unlimited
    max_concurrent: int = 0  # 0 = unlimited


@dataclass(frozen=True)
class Principal:
    """Who is calling: `key_id` is a short, non-secret label used in logs and limits."""

    key_id: str
    limits: KeyLimits


ANONYMOUS = Principal(key_id="anonymous", limits=KeyLimits())


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def parse_key_file(path: Path, default: KeyLimits) -> dict[str, Principal]:
    """digest -> Principal; raises KeyFileError with one line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(f"API key file {path}: cannot read it ({exc.strerror})") from None
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        return _parse_json(path, stripped, default)
    keys: dict[str, Principal] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip().lower()
        if not entry:
            continue
        if not _DIGEST.match(entry):
            raise KeyFileError(
                f"API key file {path}, line {lineno}: expected a sha256 hex digest (64 hex characters); "
                "store `sha256(key)`, never the key"
            )
        keys[entry] = Principal(key_id=entry[:12], limits=default)
    return keys


def _parse_json(path: Path, text: str, default: KeyLimits) -> dict[str, Principal]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KeyFileError(f"API key file {path}: not valid JSON at line {exc.lineno}") from None
    entries = [{"sha256": k, **v} for k, v in data.items()] if isinstance(data, dict) else data
    keys: dict[str, Principal] = {}
    for index, entry in enumerate(entries):
        digest = str(entry.get("sha256", "")).lower() if isinstance(entry, dict) else ""
        if not _DIGEST.match(digest):
            raise KeyFileError(f"API key file {path}, entry {index}: 'sha256' must be a sha256 hex digest")
        try:
            limits = KeyLimits(
                tokens_per_minute=int(entry.get("tokens_per_minute", default.tokens_per_minute)),
                max_concurrent=int(entry.get("max_concurrent", default.max_concurrent)),
            )
        except (TypeError, ValueError):
            raise KeyFileError(
                f"API key file {path}, entry {index}: tokens_per_minute and max_concurrent must be integers"
            ) from None
        keys[digest] = Principal(key_id=str(entry.get("name") or digest[:12]), limits=limits)
    return keys


class KeyStore:
    """Checks bearer tokens against the key file, re-reading it when it changes."""

    def __init__(self, path: Path | None, default: KeyLimits = KeyLimits()) -> None:
        self.path = path
        self.default = default
        self._keys: dict[str, Principal] = {}
        self._stamp: tuple[float, int] | None = None
        if path is not None:
            self._keys = parse_key_file(path, default)
            self._stamp = self._stat()

    @property
    def open(self) -> bool:
        return self.path is None

    def _stat(self) -> tuple[float, int] | None:
        try:
            st = self.path.stat()  # type: ignore[union-attr]
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    def refresh(self) -> None:
        """Re-read a changed key file (mounted Secrets change in place); keep the old keys if it is bad."""
        if self.path is None:
            return
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return
        try:
            self._keys = parse_key_file(self.path, self.default)
        except KeyFileError:
            return
        self._stamp = stamp

    def authenticate(self, authorization: str | None) -> Principal:
        if self.path is None:
            return Principal(key_id="anonymous", limits=self.default)
        if not authorization:
            raise Unauthorized("missing API key; send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("malformed Authorization header; send 'Authorization: Bearer <key>'")
        principal = self._keys.get(hash_key(token.strip()))
        if principal is None:
            raise Unauthorized("invalid API key")
        return principal


@dataclass
class _KeyState:
    level: float  # tokens left in the bucket; may go negative after a large request
    updated: float
    in_flight: int = 0


@dataclass
class RateLimiter:
    """Per-key token bucket (refilled at tokens_per_minute / 60 per second) and concurrency cap.

    A request is admitted while the bucket is above zero; its real usage (prompt and generated tokens)
    is charged as it happens, so one large request can push the bucket below zero and make the next
    ones wait until it refills.
    """

    clock: Callable[[], float] = time.monotonic
    _states: dict[str, _KeyState] = field(default_factory=dict)

    def _state(self, principal: Principal) -> _KeyState:
        state = self._states.get(principal.key_id)
        now = self.clock()
        if state is None:
            state = self._states[principal.key_id] = _KeyState(
                level=float(principal.limits.tokens_per_minute), updated=now
            )
        tpm = principal.limits.tokens_per_minute
        if tpm:
            state.level = min(float(tpm), state.level + (now - state.updated) * tpm / 60.0)
        state.updated = now
        return state

    def acquire(self, principal: Principal) -> None:
        """Admit one request or raise RateLimited with the seconds to wait."""
        limits = principal.limits
        if not limits.tokens_per_minute and not limits.max_concurrent:
            return
        state = self._state(principal)
        if limits.max_concurrent and state.in_flight >= limits.max_concurrent:
            raise RateLimited(
                f"API key '{principal.key_id}' has {state.in_flight} requests in flight "
                f"(limit {limits.max_concurrent}); wait for one to finish",
                retry_after=1.0,
                code="concurrency_limit_exceeded",
            )
        if limits.tokens_per_minute and state.level <= 0:
            wait = math.ceil((1.0 - state.level) * 60.0 / limits.tokens_per_minute)
            raise RateLimited(
                f"API key '{principal.key_id}' is over its limit of {limits.tokens_per_minute} tokens "
                f"per minute; retry in {wait} s",
                retry_after=wait,
                code="token_rate_limit_exceeded",
            )
        state.in_flight += 1

    def charge(self, principal: Principal, tokens: int) -> None:
        if principal.limits.tokens_per_minute and tokens:
            self._state(principal).level -= tokens

    def release(self, principal: Principal) -> None:
        limits = principal.limits
        if not limits.tokens_per_minute and not limits.max_concurrent:
            return
        state = self._states.get(principal.key_id)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1
