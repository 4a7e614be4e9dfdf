"""The fused rotary + KV-cache write kernel against the two steps it replaces."""

import re

import pytest
import torch
from modelfleet.dataplane.layers.rotary import RotaryEmbedding, rotary_embedding_native
from modelfleet.dataplane.models.config import RopeConfig

from tests.dataplane.kernels.paged_batches import TOLERANCES
from tests.dataplane.kernels.reference import rope_cos_sin, write_kv_native

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
NUM_BLOCKS = 24  # 384 slots: room for the largest case (300 tokens) plus slots no token writes


def fused_qkv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv projection output [T, (Hq + 2 Hkv) * D] and q, k, v as strided views of it, as the
    model makes them."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        qkv,
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def random_cos_sin(num_tokens: int, head_dim: int, dtype: torch.dtype, device):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    return rope_cos_sin(inv_freq, torch.randint(0, 8192, (num_tokens,), device=device), dtype)


def random_slots(num_tokens: int, device) -> torch.Tensor:
    """Distinct shuffled slots; every fifth token from the second on is padding (-1)."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:num_tokens]
    slots[1::5] = -1
    return slots


@pytest.fixture
def triton_rotary_op(device):
    """The Triton rotary kernel as the model's rotary op on the test device, as register_builtins makes it
    on any CUDA device where Triton runs (also for a CPU run under Triton's interpreter)."""
    from modelfleet.dataplane.kernels import registry
    from modelfleet.dataplane.ops import register_op, registered_ops, unregister_op

    before = registered_ops().get(("rotary_embedding", device.type))
    register_op("rotary_embedding", device.type)(registry.rotary_embedding)
    yield
    unregister_op("rotary_embedding", device.type)
    if before is not None:
        register_op("rotary_embedding", device.type)(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (8, 8), (14, 2)])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_matches_rotary_then_write_kv(device, dtype, head_dim, num_heads, num_kv_heads, num_tokens):
    from modelfleet.dataplane.kernels.kv_write import write_kv
    from modelfleet.dataplane.kernels.rotary import rotary_embedding
    from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv

    qkv, q, k, v = fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device)
    qkv_before = qkv.clone()
    cos, sin = random_cos_sin(num_tokens, head_dim, dtype, device)
    slots = random_slots(num_tokens, device)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    cache_before = cache.clone()

    got_q, got_k = rotary_and_write_kv(q, k, v, cos, sin, cache, slots)

    # the two Triton kernels it replaces: the same rounding, so the same bits
    two_step_cache = cache_before.clone()
    two_q, two_k = rotary_embedding(q, k, cos, sin)
    write_kv(two_k, v, two_step_cache, slots)
    assert torch.equal(got_q, two_q) and torch.equal(got_k, two_k)
    assert torch.equal(cache, two_step_cache)

    # the torch references: the rotation within the dtype's tolerance, like the rotary kernel's own test
    ref_cache = cache_before.clone()
    ref_q, ref_k = rotary_embedding_native(q, k, cos, sin)
    write_kv_native(ref_k, v, ref_cache, slots)
    torch.testing.assert_close(got_q, ref_q, **TOLERANCES[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOLERANCES[dtype])
    torch.testing.assert_close(cache, ref_cache, **TOLERANCES[dtype])
    assert torch.equal(cache[1], ref_cache[1])  # V is copied, never rounded

    flat = cache.view(2, -1, num_kv_heads, head_dim)
    written = slots[slots >= 0]
    assert torch.equal(flat[1, written], v[slots >= 0])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=device)
    untouched[written] = False  # padding tokens wrote nowhere, so every other slot keeps its old bits
    assert torch.equal(flat[:, untouched], cache_before.view(2, -1, num_kv_heads, head_dim)[:, untouched])
    assert torch.equal(qkv, qkv_before)  # out of place: the projection output is left as it was


def test_padding_only_batch_writes_nothing_but_still_rotates(device):
    from modelfleet.dataplane.kernels.rotary import rotary_embedding
    from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv

    _, q, k, v = fused_qkv(4, 8, 2, 64, torch.float16, device)
    cos, sin = random_cos_sin(4, 64, torch.float16, device)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 64, device=device).to(torch.float16)
    cache_before = cache.clone()
    got_q, got_k = rotary_and_write_kv(q, k, v, cos, sin, cache, torch.full((4,), -1, device=device))
    assert torch.equal(cache, cache_before)
    want_q, want_k = rotary_embedding(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_in_place_rotates_the_views_themselves(device):
    from modelfleet.dataplane.kernels.rotary import rotary_embedding
    from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv

    _, q, k, v = fused_qkv(7, 8, 2, 128, torch.float16, device)
    cos, sin = random_cos_sin(7, 128, torch.float16, device)
    want_q, want_k = rotary_embedding(q, k, cos, sin)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 128, device=device, dtype=torch.float16)
    slots = torch.arange(7, device=device) * 3
    got_q, got_k = rotary_and_write_kv(q, k, v, cos, sin, cache, slots, inplace=True)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(cache[0].view(-1, 2, 128)[slots], want_k)


def test_empty_step_launches_nothing(device):
    from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv

    _, q, k, v = fused_qkv(0, 8, 2, 64, torch.float16, device)
    cos, sin = random_cos_sin(0, 64, torch.float16, device)
    cache = torch.zeros(2, 2, BLOCK_SIZE, 2, 64, device=device, dtype=torch.float16)
    got_q, got_k = rotary_and_write_kv(
        q, k, v, cos, sin, cache, torch.empty(0, dtype=torch.long, device=device)
    )
    assert got_q.shape == (0, 8, 64) and got_k.shape == (0, 2, 64)
    assert not cache.any()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("k_strided", "contiguous last dimension"),
        ("v_strided", "v and kv_cache need a contiguous last"),
        ("cos_columns", "cos and sin need 32 columns"),
        ("cache_heads", "kv_cache holds (4, 64)"),
        ("v_shape", "v must have k's shape"),
        ("slots_short", "slot_mapping needs one slot per token (5)"),
    ],
)
def test_bad_arguments_raise_one_clear_error(device, change, message):
    from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv

    _, q, k, v = fused_qkv(5, 8, 2, 64, torch.float16, device)
    cos, sin = random_cos_sin(5, 64, torch.float16, device)
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 64, device=device, dtype=torch.float16)
    slots = torch.arange(5, device=device)
    if change == "k_strided":
        k = torch.randn(5, 2, 128, device=device).to(torch.float16)[..., ::2]
    elif change == "v_strided":
        v = torch.randn(5, 2, 128, device=device).to(torch.float16)[..., ::2]
    elif change == "cos_columns":
        cos = torch.cat([cos, cos], dim=-1)
    elif change == "cache_heads":
        cache = torch.zeros(2, 4, BLOCK_SIZE, 4, 64, device=device, dtype=torch.float16)
    elif change == "v_shape":
        v = v[:, :1]
    elif change == "slots_short":
        slots = slots[:4]
    with pytest.raises(ValueError, match="^rotary_and_write_kv: .*" + re.escape(message)):
        rotary_and_write_kv(q, k, v, cos, sin, cache, slots)


def backend_inputs(device, dtype=torch.bfloat16):
    rotary = RotaryEmbedding(
        128, RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    )
    rotary.to_device(device)
    positions = torch.randint(0, 8192, (9,), device=device)
    cos, sin = rotary.cos_sin(positions, dtype)
    _, q, k, v = fused_qkv(9, 32, 8, 128, dtype, device)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 8, 128, device=device).to(dtype)
    return rotary, q, k, v, cos, sin, cache, random_slots(9, device)


def test_triton_backend_fuses_a_rotary_embedding_with_the_same_results(device, triton_rotary_op, monkeypatch):
    from modelfleet.dataplane.attention.backend import AttentionBackend
    from modelfleet.dataplane.attention.triton_paged import TritonPagedAttention
    from modelfleet.dataplane.kernels import rotary_kv_write

    backend = TritonPagedAttention()
    rotary, q, k, v, cos, sin, cache, slots = backend_inputs(device)
    two_step_cache = cache.clone()
    want_q, want_k = AttentionBackend.rope_and_write_kv(
        backend, q, k, v, rotary, cos, sin, two_step_cache, slots
    )

    calls = []
    fused = rotary_kv_write.rotary_and_write_kv
    monkeypatch.setattr(
        rotary_kv_write, "rotary_and_write_kv", lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    )
    got_q, got_k = backend.rope_and_write_kv(q, k, v, rotary, cos, sin, cache, slots)
    assert calls == [1]
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(cache, two_step_cache)


def test_triton_backend_runs_any_other_rotary_unfused(device):
    from modelfleet.dataplane.attention.triton_paged import TritonPagedAttention

    class ScalingRotary(RotaryEmbedding):  # a subclass may compute anything: never fused
        def forward(self, q, k, cos, sin):
            return 2 * q, 3 * k

    backend = TritonPagedAttention()
    _, q, k, v, cos, sin, cache, slots = backend_inputs(device, torch.float32)
    rotary = ScalingRotary(128, RopeConfig())
    got_q, got_k = backend.rope_and_write_kv(q, k, v, rotary, cos, sin, cache, slots)
    assert torch.equal(got_q, 2 * q) and torch.equal(got_k, 3 * k)
    keep = slots >= 0
    assert torch.equal(cache[0].view(-1, 8, 128)[slots[keep]], 3 * k[keep])
    assert torch.equal(cache[1].view(-1, 8, 128)[slots[keep]], v[keep])


def test_triton_backend_honours_a_user_rotary_op(device, triton_rotary_op):
    from modelfleet.dataplane.attention.triton_paged import TritonPagedAttention
    from modelfleet.dataplane.ops import register_op

    def negated_rotary(q, k, cos, sin):
        return -q, -k

    backend = TritonPagedAttention()
    rotary, q, k, v, cos, sin, cache, slots = backend_inputs(device)
    register_op("rotary_embedding", device.type)(negated_rotary)  # the fixture restores the Triton op
    got_q, got_k = backend.rope_and_write_kv(q, k, v, rotary, cos, sin, cache, slots)
    assert torch.equal(got_q, -q) and torch.equal(got_k, -k)
    keep = slots >= 0
    assert torch.equal(cache[0].view(-1, 8, 128)[slots[keep]], -k[keep])
