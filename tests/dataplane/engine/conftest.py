"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .hf_checkpoints import ARCHITECTURES, make_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-checkpoints")
    return {name: make_checkpoint(root / name, name) for name in ARCHITECTURES}


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """Tiny matrices: one thread is faster, and on a shared machine extra threads only wait on each other.
    The engine sets its thread count at start from MODELFLEET_CPU_THREADS, the reference uses torch's."""
    import os

    import torch

    before = torch.get_num_threads(), os.environ.get("MODELFLEET_CPU_THREADS")
    torch.set_num_threads(1)
    os.environ["MODELFLEET_CPU_THREADS"] = "1"
    yield
    torch.set_num_threads(before[0])
    if before[1] is None:
        os.environ.pop("MODELFLEET_CPU_THREADS", None)
    else:
        os.environ["MODELFLEET_CPU_THREADS"] = before[1]
