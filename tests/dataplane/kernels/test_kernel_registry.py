"""The Triton kernels as the "cuda" implementations of the model ops."""

import pytest
import torch
from modelfleet.dataplane.kernels import registry
from modelfleet.dataplane.ops import get_op, unregister_op


@pytest.fixture
def registered_ops():
    from modelfleet.dataplane.registration import register_torch_ops

    register_torch_ops()  # the references every device falls back to
    assert registry.register_triton_ops(force=True)
    yield
    for name in registry.OPS:
        unregister_op(name, registry.DEVICE_TYPE)


def test_registration_replaces_the_cuda_ops_only(registered_ops):
    for name, fn in registry.OPS.items():
        assert get_op(name, "cuda") is fn
        assert get_op(name, "cpu") is not fn


@pytest.mark.gpu
def test_layers_on_cuda_use_the_kernels_and_match_the_references(device, registered_ops):
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU (the ops are registered for cuda devices)")
    from modelfleet.dataplane.layers import RMSNorm, SiluAndMul

    norm = RMSNorm(256, 1e-6).to(device, torch.bfloat16)
    x, residual = torch.randn(2, 7, 256, device=device, dtype=torch.bfloat16).unbind(0)
    got, got_sum = norm(x, residual)
    want, want_sum = norm.forward_native(x + residual, norm.weight, norm.eps), x + residual
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)
    gate_up = torch.randn(7, 512, device=device, dtype=torch.bfloat16)
    torch.testing.assert_close(
        SiluAndMul()(gate_up), SiluAndMul.forward_native(gate_up), atol=2e-2, rtol=2e-2
    )


def test_triton_backend_is_offered_only_where_triton_is_installed():
    import importlib.util

    from modelfleet.dataplane.attention import available_backends
    from modelfleet.dataplane.registration import register_builtins

    register_builtins()
    assert ("triton" in available_backends()) == (importlib.util.find_spec("triton") is not None)
