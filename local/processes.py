"""Containers as local processes: each in its own process group (so stopping it stops its children too),
its output in a log file, `modelfleet` on its command line run by this interpreter."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil


def argv(container: dict[str, Any], rewrite: Any = lambda s: s) -> list[str]:
    """command + args, with `modelfleet` run as this Python's module (the image's entry point). The
    program is this machine's (the image's stands for it) so only what follows it is mapped: a program
    path that happens to lie under a mount path (a venv under /tmp) stays as it is."""
    words = [str(w) for w in [*container.get("command", []), *container.get("args", [])]]
    words = words[:1] + [rewrite(w) for w in words[1:]]
    if not words:
        raise ValueError(f"container {container.get('name')!r} has no command; the local fleet needs one")
    if words[0] == "modelfleet":
        return [sys.executable, "-m", "modelfleet.cli", *words[1:]]
    return words


def start(words: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            words, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def stop_group(pid: int, grace: float = 10.0, exited: Any = None) -> None:
    """SIGTERM the process group led by `pid`, SIGKILL what is left after `grace` seconds. `exited`
    reaps the leader when it is our child (a zombie leader keeps its group alive until reaped)."""
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if exited is not None:
            exited()
        if not group_alive(pid):
            return
        time.sleep(0.05)
    _signal_group(pid, signal.SIGKILL)


def terminate_group(pgid: int) -> None:
    """SIGTERM to a process group, without waiting."""
    _signal_group(pgid, signal.SIGTERM)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has finished: only its parent's wait is missing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop(
    process: subprocess.Popen,
    grace: float = 10.0,
    wait: bool = True,
    after: Any = None,
    before: Any = None,
) -> threading.Thread | None:
    """Call `before`, stop a started process and its group, then call `after`; in the background
    unless `wait`."""

    def run() -> None:
        if before is not None:
            before()
        stop_group(process.pid, grace, exited=process.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        if after is not None:
            after()

    if wait:
        run()
        return None
    thread = threading.Thread(target=run, name=f"stop-{process.pid}", daemon=True)
    thread.start()
    return thread


def tail(path: Path, limit: int = 2048) -> str:
    """The end of a log, as the kubelet keeps it for FallbackToLogsOnError."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
