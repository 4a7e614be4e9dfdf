"""Kernel cases run on the CPU under Triton's interpreter (TRITON_INTERPRET=1), in a pytest of their own:
the interpreter must be on before the kernel modules are imported (`triton.jit` reads it then), and no
GPU may be visible.

That pytest takes about two minutes of one core, so a session that will run the interpreter test starts
it in the background as soon as collection ends (tests/conftest.py), beside the rest of the suite; the
test then waits for it and checks its outcome."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--timeout=240"]
TIMEOUT_S = 600


class InterpreterRun:
    """A pytest of `node_ids` (relative to tests/dataplane/kernels, e.g. "test_kernel_gemv.py::test_x[a-b]")
    under the interpreter, started at once; `outcome()` waits for it."""

    def __init__(self, node_ids: Sequence[str]) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        env.pop("PYTEST_ADDOPTS", None)  # the outer run's options (e.g. -k, -x) are not the cases'
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (read and closed with the run)
        self.process = subprocess.Popen(
            [*PYTEST, *(str(HERE / node_id) for node_id in node_ids)],
            cwd=HERE.parents[2],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def outcome(self) -> tuple[int, str]:
        """(exit code, output)."""
        try:
            code = self.process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        return code, output

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def assert_passed(run: InterpreterRun, passed: int) -> None:
    """Require exactly `passed` passing cases (more than the ids where one names a parametrized test as
    a whole) and none skipped."""
    code, output = run.outcome()
    assert code == 0, output[-4000:]
    # Every case ran: none skipped (no kernel device) or deselected (a renamed case).
    last = output.splitlines()[-1]
    # a whole number: "8 passed" must not match "18 passed"
    assert re.search(rf"(?<!\d){passed} passed", last) and "skipped" not in last, output[-2000:]


def skip_under_the_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already under the interpreter (this test starts it)")
