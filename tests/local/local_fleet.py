"""What the local-fleet tests share: the model.yaml they apply and small helpers to wait and look."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml
from modelfleet.local.fleet import Fleet
from modelfleet.operator.api import API_VERSION

MODEL = "chat"
KV_CACHE_BYTES = 1 << 18  # fewer blocks than 6 sequences of 192 tokens could fill


def model_yaml(
    *, w1: int = 70, w2: int = 30, rollout: dict[str, Any] | None = None, idle_unload_after: str | None = None
) -> list[dict[str, Any]]:
    """Model `chat` on cpu: v1 (the hardware's full-precision torch artifact) and v2 (int8, onnxruntime),
    loaded on first use so that a test can look at an artifact before any server reads it."""
    spec: dict[str, Any] = {
        "hardware": {"accelerator": "cpu"},
        "engine": {"maxModelLen": 192, "maxNumSeqs": 6, "kvCacheBytes": KV_CACHE_BYTES},
        "traffic": [{"version": "v1", "weight": w1}, {"version": "v2", "weight": w2}],
        "loading": {"mode": "lazy"},
    }
    if rollout is not None:
        spec["rollout"] = rollout
    if idle_unload_after is not None:
        spec["loading"]["idleUnloadAfter"] = idle_unload_after
    return [
        {"apiVersion": API_VERSION, "kind": "InferenceModel", "metadata": {"name": MODEL}, "spec": spec},
        version_doc("v1", "pvc://models/chat/v1"),
        version_doc("v2", "pvc://models/chat/v2", quantization="int8"),
    ]


def version_doc(version: str, uri: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelVersion",
        "metadata": {"name": f"{MODEL}-{version}"},
        "spec": {"model": MODEL, "version": version, "source": {"uri": uri}, **spec},
    }


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def model(fleet: Fleet) -> dict[str, Any]:
    found = fleet.kube.get(API_VERSION, "InferenceModel", "default", MODEL)
    assert found is not None
    return found


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_)


def serving_pods(fleet: Fleet) -> list[dict[str, Any]]:
    return fleet.kube.list(
        "v1", "Pod", "default", {"modelfleet.dev/model": MODEL, "app.kubernetes.io/component": "dataplane"}
    )


def descendants() -> set[int]:
    """The fleet's processes below this one. The fleet starts each pod's process in a session of its own,
    which sets them apart from what other tests of the session leave running here (a multiprocessing
    forkserver lives as long as the test process)."""
    own_session = os.getsid(0)
    found = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if os.getsid(process.pid) != own_session:
                found.add(process.pid)
        except ProcessLookupError:
            pass
    return found


def alive(pids: set[int]) -> set[int]:
    """The processes among `pids` still running (a zombie has exited)."""
    found = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.add(pid)
        except psutil.NoSuchProcess:
            pass
    return found


def load_yaml(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
