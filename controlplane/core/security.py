"""API keys: a random token with a short public prefix, stored as the prefix and a keyed hash only.

A key reads `mf_<prefix>_<secret>`. The prefix finds the row; the hash proves the secret. The hash is
HMAC-SHA256 under a per-tenant pepper derived from the server's pepper, so the Secret mounted by a
tenant's data-plane pods can carry that tenant's pepper without exposing the server's or another tenant's.
Keys carry 256 random bits, so a fast keyed hash is enough (slow hashes are for guessable passwords).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

KEY_SCHEME = "mf"
PREFIX_LENGTH = 8
HASH_ALGORITHM = "hmac-sha256"
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class NewKey:
    token: str  # shown once to the caller, never stored or logged
    prefix: str
    key_hash: str

    def __repr__(self) -> str:  # keeps the token out of tracebacks and debug logs
        return f"NewKey(prefix={self.prefix!r})"


def tenant_pepper(server_pepper: str, namespace: str) -> bytes:
    return hmac.new(server_pepper.encode(), f"tenant:{namespace}".encode(), hashlib.sha256).digest()


def hash_key(token: str, pepper: bytes) -> str:
    return hmac.new(pepper, token.encode(), hashlib.sha256).hexdigest()


def new_key(pepper: bytes) -> NewKey:
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LENGTH))
    token = f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}"
    return NewKey(token=token, prefix=prefix, key_hash=hash_key(token, pepper))


def parse_prefix(token: str) -> str | None:
    """The public prefix of a well-formed key, else None."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != PREFIX_LENGTH or not parts[2]:
        return None
    return parts[1]


def key_matches(token: str, key_hash: str, pepper: bytes) -> bool:
    return hmac.compare_digest(hash_key(token, pepper), key_hash)


def secret_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
