"""Progress reporting: rich bars on a terminal, plain log lines on stderr otherwise (Jobs, CI)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Task(Protocol):
    def advance(self, amount: float = 1) -> None: ...


class _PlainTask:
    """Logs at every quarter of the way and at the end, so a Job's log stays short."""

    def __init__(self, description: str, total: float | None) -> None:
        self.description, self.total, self.done, self.next_mark = description, total, 0.0, 0.25
        self.started = time.monotonic()
        log(f"{description}: started")

    def advance(self, amount: float = 1) -> None:
        self.done += amount
        if self.total and self.done / self.total >= self.next_mark and self.done < self.total:
            log(f"{self.description}: {int(100 * self.done / self.total)}%")
            while self.next_mark <= self.done / self.total:
                self.next_mark += 0.25

    def finish(self) -> None:
        log(f"{self.description}: done in {time.monotonic() - self.started:.1f}s")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def use_rich() -> bool:
    if not sys.stderr.isatty():
        return False
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def task(description: str, total: float | None = None, *, bytes_: bool = False) -> Iterator[Task]:
    """One step of the conversion; `total=None` shows a spinner/indeterminate step."""
    if use_rich():
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
        columns += [DownloadColumn()] if bytes_ else []
        with Progress(*columns, TimeElapsedColumn(), transient=False) as progress:
            task_id = progress.add_task(description, total=total)

            class _RichTask:
                def advance(self, amount: float = 1) -> None:
                    progress.advance(task_id, amount)

            yield _RichTask()
            progress.update(task_id, completed=total or 1, total=total or 1)
        return
    plain = _PlainTask(description, total)
    yield plain
    plain.finish()
