"""API keys: a random token with a short public prefix, stored as the prefix and a keyed hash only.

A key reads `mf_<prefix>_<secret>`. The prefix finds the row; the hash proves the secret. The database
keeps HMAC-SHA256 under the server's pepper, so a copy of the database alone verifies nothing. The
data-plane pods check the plain SHA-256 digest that their key file holds (dataplane/server/auth.py); that
digest is computed only while the token is at hand, at creation, and goes only into the tenant's Secret.
Keys carry 256 random bits, so a fast hash is enough (slow hashes are for guessable passwords).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

KEY_SCHEME = "mf"
PREFIX_LENGTH = 8
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class NewKey:
    token: str  # shown once to the caller, never stored or logged
    prefix: str
    key_hash: str

    def __repr__(self) -> str:  # keeps the token out of tracebacks and debug logs
        return f"NewKey(prefix={self.prefix!r})"


def hash_key(token: str, pepper: str) -> str:
    return hmac.new(pepper.encode(), token.encode(), hashlib.sha256).hexdigest()


def serving_digest(token: str) -> str:
    """What a data-plane key file holds for this token."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_key(pepper: str) -> NewKey:
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LENGTH))
    token = f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}"
    return NewKey(token=token, prefix=prefix, key_hash=hash_key(token, pepper))


def parse_prefix(token: str) -> str | None:
    """The public prefix of a well-formed key, else None."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != PREFIX_LENGTH or not parts[2]:
        return None
    return parts[1]


def key_matches(token: str, key_hash: str, pepper: str) -> bool:
    return hmac.compare_digest(hash_key(token, pepper), key_hash)


def secret_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
