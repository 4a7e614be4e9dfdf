"""The A/B router: pure functions from (routing table, request keys, randomness) to a version.

- weighted random split over the versions' weights;
- sticky routing by a key (the OpenAI `user` field or a header) with weighted rendezvous hashing: every
  replica picks the same version for a key without shared state, and a weight change moves only the keys
  that must move (between two versions exactly the weight difference);
- a pin `model@version` bypasses the weights;
- shadow traffic: each version with `shadow_percent > 0` also receives that share of the model's requests
  as mirrors whose answers are discarded.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Literal, NamedTuple

from modelfleet.dataplane.manifest import ServedModel

_HASH_SCALE = float(1 << 64)


class RouteError(Exception):
    """No version can take this request; `status` is the HTTP status it maps onto."""

    def __init__(self, message: str, *, status: int, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class RoutingTable:
    """One model's routing state, precomputed from the manifest so each decision is cheap."""

    model: str
    versions: tuple[str, ...]
    weights: tuple[int, ...]
    cumulative: tuple[int, ...]
    sticky_kind: Literal["none", "user", "header"]
    sticky_header: str | None
    shadows: tuple[tuple[str, int], ...]  # (version, percent)
    salts: tuple[bytes, ...]  # per version, for sticky hashing

    @classmethod
    def from_model(cls, model: ServedModel) -> RoutingTable:
        weights = tuple(v.weight for v in model.versions)
        cumulative, total = [], 0
        for w in weights:
            total += w
            cumulative.append(total)
        return cls(
            model=model.name,
            versions=tuple(v.name for v in model.versions),
            weights=weights,
            cumulative=tuple(cumulative),
            sticky_kind=model.routing.sticky_kind,
            sticky_header=model.routing.sticky_header,
            shadows=tuple((v.name, v.shadow_percent) for v in model.versions if v.shadow_percent > 0),
            salts=tuple(_version_salt(v.name) for v in model.versions),
        )


class RouteDecision(NamedTuple):
    model: str
    version: str
    reason: Literal["pin", "sticky", "weighted"]
    shadows: tuple[str, ...] = ()


def split_model_field(model_field: str) -> tuple[str, str | None]:
    """'name@version' -> ('name', 'version'); 'name' -> ('name', None)."""
    name, sep, version = model_field.partition("@")
    return name, (version if sep else None)


def weighted_choice(table: RoutingTable, draw: float) -> str:
    """The version whose cumulative-weight interval holds `draw` (uniform in [0, 1))."""
    total = table.cumulative[-1]
    if total <= 0:
        raise RouteError(
            f"model '{table.model}' has no version with traffic weight; pin one with 'model@version'",
            status=503,
            code="no_servable_version",
        )
    point = draw * total
    for name, edge in zip(table.versions, table.cumulative, strict=True):
        if point < edge:
            return name
    return table.versions[-1]  # draw == 1.0 guard


def _version_salt(version: str) -> bytes:
    return hashlib.blake2b(version.encode(), digest_size=32).digest()


def _unit_hash(key: bytes, salt: bytes) -> float:
    """A uniform number in (0, 1) from (key, version), stable across processes and replicas."""
    digest = hashlib.blake2b(key, digest_size=8, key=salt).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _HASH_SCALE


def sticky_choice(table: RoutingTable, key: str) -> str:
    """Weighted rendezvous hashing: the version with the highest weight / -ln(hash(key, version)).

    Each version's score is an exponential race scaled by its weight, so a key lands on a version with
    probability weight / total, and raising one weight only pulls keys towards that version.
    """
    best_name, best_score = None, -1.0
    raw = key.encode()
    for name, weight, salt in zip(table.versions, table.weights, table.salts, strict=True):
        if weight <= 0:
            continue
        score = weight / -math.log(_unit_hash(raw, salt))
        if score > best_score:
            best_name, best_score = name, score
    if best_name is None:
        return weighted_choice(table, 0.0)  # raises the no-weight error
    return best_name


def sticky_key(table: RoutingTable, *, user: str | None, headers: dict[str, str]) -> str | None:
    """The key that sticky routing hashes, or None when the model is not sticky or the key is absent."""
    if table.sticky_kind == "user":
        return user or None
    if table.sticky_kind == "header" and table.sticky_header:
        return headers.get(table.sticky_header.lower()) or None
    return None


def route(
    table: RoutingTable,
    *,
    pinned: str | None = None,
    key: str | None = None,
    rng: random.Random | None = None,
) -> RouteDecision:
    """Pick the version for one request, plus the versions that get a shadow copy of it."""
    uniform = rng.random if rng is not None else random.random
    reason: Literal["pin", "sticky", "weighted"]
    if pinned is not None:
        if pinned not in table.versions:
            known = ", ".join(table.versions)
            raise RouteError(
                f"model '{table.model}' has no version '{pinned}'; known versions: {known}",
                status=404,
                code="model_not_found",
            )
        version, reason = pinned, "pin"
    elif key is not None:
        version, reason = sticky_choice(table, key), "sticky"
    else:
        version, reason = weighted_choice(table, uniform()), "weighted"
    shadows: tuple[str, ...] = ()
    if table.shadows:
        shadows = tuple(n for n, percent in table.shadows if n != version and uniform() * 100 < percent)
    return RouteDecision(table.model, version, reason, shadows)
