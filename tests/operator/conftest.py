"""Shared fixtures of the operator tests: the generated CRDs and their schemas."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from modelfleet.operator import crdgen
from modelfleet.operator.triggers import Triggers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_triggers(monkeypatch):
    """Each test starts with an operator that has reconciled nothing; a handler test that calls the
    resync timer directly means "the resync is due", so it is never skipped as too soon."""
    handlers = sys.modules.get("modelfleet.operator.handlers")
    if handlers is not None:
        monkeypatch.setattr(handlers, "TRIGGERS", Triggers())
        monkeypatch.setattr(handlers, "RESYNC_SKIP_SECONDS", 0.0)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def crd_files() -> dict[str, dict[str, Any]]:
    """The checked-in CRDs, by kind."""
    crds = {}
    for name in crdgen.all_crds():
        crd = yaml.safe_load((ROOT / "crds" / name).read_text())
        crds[crd["spec"]["names"]["kind"]] = crd
    return crds


@pytest.fixture(scope="session")
def schemas(crd_files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """openAPIV3Schema of each checked-in CRD, by kind."""
    return {kind: crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] for kind, crd in crd_files.items()}


@pytest.fixture()
def example_objects() -> dict[str, dict[str, Any]]:
    """examples/model.yaml as the API server would return it: namespaced, with uid and generation."""
    objects = {}
    for index, doc in enumerate(yaml.safe_load_all((ROOT / "examples" / "model.yaml").read_text())):
        doc["metadata"].update(
            namespace="team-a", uid=f"00000000-0000-0000-0000-00000000000{index}", generation=1
        )
        objects[doc["metadata"]["name"]] = doc
    return objects
