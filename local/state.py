"""The fleet's work dir as the meeting point of shells: `state.json` (the supervisor's pid, endpoints,
pods with their pids and ports, the objects and events) lets `status` and `down` work from anywhere, and
`inbox/` carries `apply` and `delete` requests to the running supervisor."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from modelfleet.local import processes

STATE = "state.json"
INBOX = "inbox"


class NotRunning(ValueError):
    """No fleet runs in this work dir."""


def _pid_alive(pid: int | None) -> bool:
    return bool(pid) and processes.alive(pid)


def read(work_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((work_dir / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def running_pid(work_dir: Path) -> int | None:
    """The pid of the supervisor running this work dir's fleet, None when none runs."""
    found = read(work_dir)
    pid = (found or {}).get("pid")
    return pid if found and not found.get("stopped") and _pid_alive(pid) else None


def claim(work_dir: Path) -> None:
    """Take the work dir for this process; refuses when another live fleet holds it."""
    pid = running_pid(work_dir)
    if pid is not None and pid != os.getpid():
        raise ValueError(
            f"a local fleet already runs in {work_dir} (pid {pid}); `modelfleet local down` first"
        )
    left = [p["pid"] for p in ((read(work_dir) or {}).get("pods") or {}).values() if p.get("pid")]
    if any(processes.group_alive(pgid) for pgid in left):
        raise ValueError(
            f"processes of a local fleet that died still run in {work_dir}; `modelfleet local down` first"
        )
    write(work_dir, {})


def write(work_dir: Path, snapshot: dict[str, Any]) -> None:
    body = {"pid": os.getpid(), "updated": time.time(), **snapshot}
    tmp = work_dir / f".{STATE}.tmp"
    tmp.write_text(json.dumps(body, indent=1), encoding="utf-8")
    os.replace(tmp, work_dir / STATE)


def release(work_dir: Path) -> None:
    found = read(work_dir) or {}
    if found.get("pid") == os.getpid():
        write(work_dir, {**{k: v for k, v in found.items() if k not in ("pid", "updated")}, "stopped": True,
                         "pods": {}, "endpoints": {}})  # fmt: skip


# --- requests from other shells ----------------------------------------------------------------------------


def submit(work_dir: Path, op: str, docs: list[Any], timeout: float = 30.0) -> dict[str, Any]:
    """Hand `docs` to the running fleet and wait for its answer."""
    if running_pid(work_dir) is None:
        raise NotRunning(f"no local fleet runs in {work_dir}; start one with `modelfleet local up -f FILE`")
    inbox = work_dir / INBOX
    inbox.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-{os.getpid()}"
    tmp = inbox / f".{name}.tmp"
    tmp.write_text(json.dumps({"op": op, "docs": docs}), encoding="utf-8")
    os.replace(tmp, inbox / f"{name}.json")
    answer = inbox / f"{name}.answer"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answer.is_file():
            result = json.loads(answer.read_text(encoding="utf-8"))
            answer.unlink(missing_ok=True)
            return result
        time.sleep(0.1)
    raise TimeoutError(f"the local fleet in {work_dir} did not answer within {timeout:.0f} s")


def inbox(work_dir: Path) -> list[dict[str, Any]]:
    """Pending requests, oldest first; each is taken off the inbox as it is read."""
    found = []
    for path in sorted((work_dir / INBOX).glob("*.json")):
        try:
            request = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            request = {"op": "invalid"}
        path.unlink(missing_ok=True)
        found.append({**request, "_answer": str(path.with_suffix(".answer"))})
    return found


def answer(request: dict[str, Any], result: dict[str, Any]) -> None:
    path = Path(request["_answer"])
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, path)
