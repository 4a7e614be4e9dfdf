"""Kernel cases run on the CPU under Triton's interpreter (TRITON_INTERPRET=1), in a pytest of their own:
the interpreter must be on before the kernel modules are imported (`triton.jit` reads it then), and no
GPU may be visible."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--timeout=240"]


def assert_pass_under_the_interpreter(node_ids: Sequence[str], passed: int) -> None:
    """Run `node_ids` (pytest node ids relative to tests/dataplane/kernels, e.g.
    "test_kernel_gemv.py::test_x[a-b]") under the interpreter and require exactly `passed` passing cases
    (more than the ids where one names a parametrized test as a whole) and none skipped."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already under the interpreter (this test starts it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's options (e.g. -k, -x) are not the cases'
    proc = subprocess.run(
        [*PYTEST, *(str(HERE / node_id) for node_id in node_ids)],
        cwd=HERE.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    # Every case ran: none skipped (no kernel device) or deselected (a renamed case).
    last = output.splitlines()[-1]
    # a whole number: "8 passed" must not match "18 passed"
    assert re.search(rf"(?<!\d){passed} passed", last) and "skipped" not in last, output[-2000:]
