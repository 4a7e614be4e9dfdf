"""Fixtures shared by every component's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the network: transformers loads everything from local folders.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model (seed 0), written once per test session. Treat it as read-only."""
    from modelfleet.dataplane.demo import create_demo_model

    return create_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", seed=0)
