"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .hf_checkpoints import ARCHITECTURES, make_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-checkpoints")
    return {name: make_checkpoint(root / name, name) for name in ARCHITECTURES}
