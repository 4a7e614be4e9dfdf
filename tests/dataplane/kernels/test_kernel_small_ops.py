import pytest
import torch

from tests.dataplane.kernels.paged_batches import TOLERANCES
from tests.dataplane.kernels.reference import (
    rms_norm_native,
    rope_cos_sin,
    rotary_embedding_native,
    silu_and_mul_native,
)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 2048, 4096, 5120])
@pytest.mark.parametrize("num_tokens", [1, 83])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, hidden_size, num_tokens, with_residual):
    from modelfleet.dataplane.kernels.rms_norm import rms_norm

    x = torch.randn(num_tokens, hidden_size, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden_size, device=device)).to(dtype)
    residual = torch.randn_like(x) if with_residual else None
    got = rms_norm(x, weight, 1e-5, residual)
    want = rms_norm_native(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the sum rounds exactly as torch's
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_rms_norm_in_place(device):
    from modelfleet.dataplane.kernels.rms_norm import rms_norm

    x = torch.randn(5, 256, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(256, device=device, dtype=torch.bfloat16)
    want, want_sum = rms_norm_native(x, weight, 1e-6, residual)
    rms_norm(x, weight, 1e-6, residual, out=x, residual_out=residual)
    torch.testing.assert_close(x, want, **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(residual, want_sum, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 64), (8, 8, 128), (12, 4, 80)])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_matches_reference(device, dtype, num_heads, num_kv_heads, head_dim, inplace):
    from modelfleet.dataplane.kernels.rotary import rotary_embedding

    num_tokens = 45
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    cos, sin = rope_cos_sin(inv_freq, torch.randint(0, 8192, (num_tokens,), device=device), dtype)
    # q and k as views of one fused qkv projection (strided, as the model makes them)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    qkv_before = qkv.clone()
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    want_q, want_k = rotary_embedding_native(q, k, cos, sin)
    got_q, got_k = rotary_embedding(q, k, cos, sin, inplace=inplace)
    torch.testing.assert_close(got_q, want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(got_k, want_k, **TOLERANCES[dtype])
    v_cols = slice((num_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_cols], qkv_before[:, v_cols])  # v untouched either way
    if inplace:
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    else:
        assert torch.equal(qkv, qkv_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8192), (67, 2 * 5632), (3, 2, 200)])
def test_silu_and_mul_matches_reference(device, dtype, shape):
    from modelfleet.dataplane.kernels.activation import silu_and_mul

    x = (3 * torch.randn(*shape, device=device)).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_native(x), **TOLERANCES[dtype])
