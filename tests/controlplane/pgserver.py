"""A throwaway PostgreSQL server in a temporary folder, for the control-plane tests and bench/controlplane.py.

Uses Debian's `postgresql` binaries. As root (CI), initdb and pg_ctl refuse to run, so they run as the
`postgres` user through runuser and the folder is handed to that user. The server listens on a unix
socket in its own folder only, so it never collides with another server on the machine.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "postgresql"  # the Debian package that provides the binaries


def find_bin_dir() -> Path | None:
    """The newest /usr/lib/postgresql/<major>/bin holding pg_ctl, or pg_ctl's folder on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def missing_reason() -> str | None:
    """Why a server cannot be started here, or None if it can."""
    if find_bin_dir() is None:
        return f"PostgreSQL binaries (initdb, pg_ctl) not found; install the Debian package '{PACKAGE}'"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return f"running as root but there is no 'postgres' user; install the Debian package '{PACKAGE}'"
    return None


class PostgresServer:
    def __init__(self) -> None:
        reason = missing_reason()
        if reason:
            raise RuntimeError(reason)
        self.bin_dir = find_bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="modelfleet-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root
        self.port = 5432
        self.log = self.root / "server.log"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        self.start()

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        command = [str(self.bin_dir / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(
                f"{tool} failed: {result.stderr.strip() or result.stdout.strip()}\n{log[-2000:]}"
            )
        return result

    def start(self) -> None:
        # Durability off: a test database needs none of it, and commits get much cheaper.
        options = (
            f"-k {self.socket_dir} -p {self.port} -c listen_addresses='' -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "30", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.socket_dir}&port={self.port}"

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """A new database (a file copy of `template` when given, which is quicker than migrating)."""
        import psycopg

        clause = f' TEMPLATE "{template}" STRATEGY FILE_COPY' if template else ""
        with psycopg.connect(
            host=str(self.socket_dir), port=self.port, user="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"{clause}')
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
