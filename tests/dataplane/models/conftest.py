import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Lets the tests here import the checkpoint factory (model_checkpoints.py) as a plain module.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """Tiny tensors: a second OpenMP thread only adds synchronisation, and on a shared CI machine
    with busy cores it makes every op several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
