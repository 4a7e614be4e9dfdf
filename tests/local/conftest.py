"""One local fleet for the module that asks for it: two demo checkpoints on a local PVC root, converted
and served by the real `modelfleet convert` and `modelfleet serve` processes that the operator's reconcile
asks for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from local_fleet import condition, model, model_yaml, wait_for
from modelfleet.local.fleet import Fleet
from modelfleet.operator.api import API_VERSION
from modelfleet.operator.settings import OperatorSettings


@pytest.fixture(scope="session")
def pvc_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PVC root: claim `models` holds the two demo checkpoints (seeds 0 and 1)."""
    from modelfleet.dataplane.demo import create_demo_model

    root = tmp_path_factory.mktemp("pvc")
    create_demo_model(root / "models" / "chat" / "v1", size="tiny", seed=0)
    create_demo_model(root / "models" / "chat" / "v2", size="tiny", seed=1)
    return root


@pytest.fixture(scope="module")
def fleet(pvc_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The fleet of `model_yaml()`, once both versions are converted and a replica is ready."""
    settings = OperatorSettings(rollout_tick_seconds=0.5)
    running = Fleet(tmp_path_factory.mktemp("fleet"), pvc_root=pvc_root, port=0, settings=settings).start()
    try:
        running.apply(model_yaml())

        def ready() -> bool:
            replicas = list(running.deployments.replicas.values())
            manifests = [r.container.folder / "volumes" / "manifest" / "manifest.yaml" for r in replicas]
            if not manifests or not all(m.is_file() and "cpu-onnx-int8" in m.read_text() for m in manifests):
                return False  # the pods' files have not caught up with the int8 artifact yet
            for mv in running.kube.list(API_VERSION, "ModelVersion", "default"):
                if (mv.get("status") or {}).get("phase") == "Failed":  # say why at once, not at the timeout
                    raise AssertionError(f"{mv['metadata']['name']}: {condition(mv, 'Ready')['message']}")
            im = model(running)
            return (
                condition(im, "Ready")["status"] == "True"
                and im["status"]["traffic"] == "v1=70,v2=30"
                and all(
                    (mv.get("status") or {}).get("phase") == "Ready"
                    for mv in running.kube.list(API_VERSION, "ModelVersion", "default")
                )
            )

        wait_for(
            lambda: running.error is None and "status" in model(running) and ready(),
            180,
            "the fleet to be Ready",
        )
        yield running
    finally:
        running.stop()
