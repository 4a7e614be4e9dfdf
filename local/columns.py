"""`kubectl get im,mv -o wide` for the local fleet: the CRDs' additionalPrinterColumns, their simple
JSONPaths evaluated on the stored objects (`.a.b`, `.a[0]`, `.a[?(@.k=="v")].b`)."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from modelfleet.local.admission import crds
from modelfleet.operator.api import GROUP

_STEP = re.compile(r"""\.([A-Za-z0-9_-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_-]+)\s*==\s*["']([^"']*)["']\)\]""")


def evaluate(path: str, obj: Any) -> list[Any]:
    """Every value `path` reaches in `obj` (a filter may reach several)."""
    values = [obj]
    position = 0
    while position < len(path):
        match = _STEP.match(path, position)
        if match is None:
            raise ValueError(f"JSONPath {path!r}: cannot read {path[position:]!r}")
        position = match.end()
        field, index, key, wanted = match.groups()
        found: list[Any] = []
        for value in values:
            if field is not None and isinstance(value, dict) and field in value:
                found.append(value[field])
            elif index is not None and isinstance(value, list) and int(index) < len(value):
                found.append(value[int(index)])
            elif key is not None and isinstance(value, list):
                found += [item for item in value if isinstance(item, dict) and str(item.get(key)) == wanted]
        values = found
    return values


def age(stamp: str | None, now: dt.datetime | None = None) -> str:
    """kubectl's short age: 45s, 12m, 3h, 2d."""
    if not stamp:
        return "<unknown>"
    then = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    seconds = int(((now or dt.datetime.now(dt.UTC)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def cell(column: dict[str, Any], obj: dict[str, Any]) -> str:
    values = evaluate(column["jsonPath"], obj)
    if not values or values[0] is None:
        return "<none>" if column.get("type") != "date" else "<unknown>"
    if column.get("type") == "date":
        return age(str(values[0]))
    return ",".join(str(v) for v in values)


def table(kind: str, objects: list[dict[str, Any]], wide: bool = False) -> str:
    """The objects of `kind` as kubectl prints them (several kinds: names prefixed with kind.group)."""
    crd = crds()[kind]
    columns = [
        c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"] if wide or not c.get("priority")
    ]
    prefix = f"{kind.lower()}.{GROUP}/"
    rows = [["NAME", *(c["name"].upper() for c in columns)]]
    for obj in objects:
        if obj.get("kind") == kind:
            rows.append([prefix + obj["metadata"]["name"], *(cell(c, obj) for c in columns)])
    return _render(rows) if len(rows) > 1 else ""


def _render(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def events_table(events: list[dict[str, Any]]) -> str:
    """Events as `kubectl get events` lists them, oldest first."""
    rows = [["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]]
    for e in events:
        rows.append(
            [age(e.get("time")), e["type"], e["reason"], f"{e['kind'].lower()}/{e['name']}", e["message"]]
        )
    return _render(rows) if len(rows) > 1 else ""
