import pytest
import torch

from tests.dataplane.kernels.reference import write_kv_native

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(8, 128), (2, 64), (3, 80)])
def test_write_kv_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    from modelfleet.dataplane.kernels.kv_write import write_kv

    num_blocks, num_tokens = 9, 37
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[5] = -1  # padding token: must leave the cache untouched
    # k and v as strided views of a fused qkv projection, as the model produces them
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=device).to(dtype)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    write_kv(k, v, cache, slots)
    write_kv_native(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
