"""GPU kernel tests: they run on a CUDA device, or on the CPU under Triton's interpreter when
TRITON_INTERPRET=1 (slow; for small cases), and are skipped elsewhere."""

import importlib.util
import os

import pytest
import torch


def kernel_device() -> torch.device | None:
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    return None


@pytest.fixture(autouse=True, scope="session")
def torch_reference_ops() -> None:
    """The layers' torch references as every device's ops, as the engine's start registers them; a test
    that wants a kernel as an op registers it itself."""
    from modelfleet.dataplane.registration import register_torch_ops

    register_torch_ops()


@pytest.fixture
def device() -> torch.device:
    found = kernel_device()
    if found is None:
        pytest.skip("needs a CUDA GPU (with Triton)")
    torch.manual_seed(0)
    return found
