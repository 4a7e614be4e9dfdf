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
from collections import deque
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


WINDOW_SECONDS = 60.0


@dataclass
class Reservation:
    """Tokens set aside for one request before it runs; `used` is what it really took, once known."""

    key_id: str
    entry: list  # [time, tokens] in the key's window
    used: int | None = None


@dataclass
class _KeyState:
    charges: deque = field(default_factory=deque)  # [time, tokens], oldest first, within the window
    in_flight: int = 0


@dataclass
class RateLimiter:
    """Per-key tokens per minute and concurrency cap, each this replica's share of the key's limits.

    Tokens: at most `tokens_per_minute` in any 60 s window. A request reserves its prompt tokens plus
    its most generated tokens (max_tokens per sequence) before it runs, and is refused (429 with the
    wait) when that does not fit; when it ends, the reservation shrinks to what it used.

    Replicas: `replicas()` says how many servers share the key's limits; each enforces its share, so a
    tenant spread over the replicas by the Service gets its limit in all, not that many times over.
    """

    clock: Callable[[], float] = time.monotonic
    replicas: Callable[[], int] = lambda: 1
    _states: dict[str, _KeyState] = field(default_factory=dict)

    def shares(self, limits: KeyLimits) -> tuple[int, int]:
        """This replica's tokens per minute and concurrency (0 = unlimited, else at least 1)."""
        count = max(1, self.replicas())

        def share(value: int) -> int:
            return max(1, value // count) if value else 0

        return share(limits.tokens_per_minute), share(limits.max_concurrent)

    def _state(self, principal: Principal) -> tuple[_KeyState, float, int]:
        """The key's state with charges older than the window dropped, the time, and tokens in the window."""
        state = self._states.setdefault(principal.key_id, _KeyState())
        now = self.clock()
        while state.charges and state.charges[0][0] <= now - WINDOW_SECONDS:
            state.charges.popleft()
        return state, now, sum(tokens for _, tokens in state.charges)

    def _wait(self, state: _KeyState, now: float, used: int, room: int) -> float:
        """Seconds until at most `room` tokens are left in the window (the oldest charges leave first)."""
        wait = 0.0
        for when, tokens in state.charges:
            if used <= room:
                break
            used -= tokens
            wait = when + WINDOW_SECONDS - now
        return max(wait, 1.0)

    def acquire(self, principal: Principal) -> None:
        """Admit one request or raise RateLimited with the seconds to wait (the window is full)."""
        tpm, concurrent = self.shares(principal.limits)
        if not tpm and not concurrent:
            return
        state, now, used = self._state(principal)
        if concurrent and state.in_flight >= concurrent:
            raise RateLimited(
                f"API key '{principal.key_id}' has {state.in_flight} requests in flight "
                f"(limit {concurrent}{self._on_replica()}); wait for one to finish",
                retry_after=1.0,
                code="concurrency_limit_exceeded",
            )
        if tpm and used >= tpm:
            wait = math.ceil(self._wait(state, now, used, tpm - 1))
            raise RateLimited(
                f"API key '{principal.key_id}' is over its limit of {tpm} tokens per minute"
                f"{self._on_replica()}; retry in {wait} s",
                retry_after=wait,
                code="token_rate_limit_exceeded",
            )
        state.in_flight += 1

    def reserve(self, principal: Principal, tokens: int) -> Reservation | None:
        """Set `tokens` aside in the key's window, or raise RateLimited saying when they would fit."""
        tpm, _ = self.shares(principal.limits)
        if not tpm:
            return None
        state, now, used = self._state(principal)
        if tokens > tpm:
            raise RateLimited(
                f"request needs up to {tokens} tokens (prompt plus max_tokens for each sequence), over "
                f"API key '{principal.key_id}''s limit of {tpm} tokens per minute{self._on_replica()}; "
                "lower max_tokens or n, or send fewer or shorter prompts",
                retry_after=WINDOW_SECONDS,
                code="token_rate_limit_exceeded",
            )
        if used + tokens > tpm:
            wait = math.ceil(self._wait(state, now, used, tpm - tokens))
            raise RateLimited(
                f"API key '{principal.key_id}' has {tpm - used} of its {tpm} tokens per minute left"
                f"{self._on_replica()} and this request needs up to {tokens}; retry in {wait} s",
                retry_after=wait,
                code="token_rate_limit_exceeded",
            )
        entry = [now, tokens]
        state.charges.append(entry)
        return Reservation(principal.key_id, entry)

    def settle(self, reservation: Reservation | None) -> None:
        """The request ended: keep what it used of its reservation (nothing if it never ran)."""
        if reservation is not None:
            reservation.entry[1] = min(reservation.entry[1], reservation.used or 0)

    def charge(self, principal: Principal, tokens: int) -> None:
        """Count tokens used outside a reservation."""
        if principal.limits.tokens_per_minute and tokens:
            state, now, _ = self._state(principal)
            state.charges.append([now, tokens])

    def release(self, principal: Principal) -> None:
        tpm, concurrent = self.shares(principal.limits)
        if not tpm and not concurrent:
            return
        state = self._states.get(principal.key_id)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def _on_replica(self) -> str:
        count = self.replicas()
        return f", this replica's share of {count}" if count > 1 else ""
