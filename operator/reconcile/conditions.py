"""Status conditions of the standard Kubernetes shape, with stable transition times."""

from __future__ import annotations

import datetime as dt
from typing import Any


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    """A condition without its transition time (`merge_conditions` adds it)."""
    cond: dict[str, Any] = {
        "type": type_,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(old: list[dict[str, Any]] | None, new: list[dict[str, Any]], now: str) -> list[dict]:
    """`new` conditions, keeping each one's lastTransitionTime from `old` while its status is unchanged,
    so that re-reconciling an unchanged object writes nothing."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        unchanged = before is not None and before.get("status") == cond["status"]
        merged.append(
            {**cond, "lastTransitionTime": before.get("lastTransitionTime", now) if unchanged else now}
        )
    return merged


def find(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)
