"""The decode-path kernels back to back in one captured CUDA graph, as a decode step runs them.

With programmatic dependent launch (on by default on Hopper and newer) each kernel may be scheduled
while its predecessor is still running; a kernel that read its input before waiting for the predecessor
would see the previous replay's values. Every replay feeds fresh inputs and every stage is checked
against the torch reference of what its own predecessor produced in that replay, so such a race shows up
as a mismatch at the stage that raced.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from modelfleet.dataplane.kernels import availability

from tests.dataplane.kernels.paged_batches import TOLERANCES, random_paged_batch
from tests.dataplane.kernels.reference import (
    paged_attention_native,
    rms_norm_native,
    rope_cos_sin,
    rotary_embedding_native,
    silu_and_mul_native,
)

# A Llama-3.2-1B-shaped layer (hidden 2048, 32/8 heads of 64, MLP 8192) and a smaller vocabulary
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTER, VOCAB = 2048, 32, 8, 64, 8192, 32768
BLOCK_SIZE = 16
EPS = 1e-5
DTYPE = torch.bfloat16
REPLAYS = 6


@dataclasses.dataclass
class Weights:
    norm_in: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_final: torch.Tensor
    lm_head: torch.Tensor


def random_weights(device: torch.device) -> Weights:
    def linear(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=device) / k**0.5).to(DTYPE)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(DTYPE)

    return Weights(
        norm_in=norm(),
        qkv=linear((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN),
        o=linear(HIDDEN, NUM_HEADS * HEAD_DIM),
        norm_post=norm(),
        gate_up=linear(2 * INTER, HIDDEN),
        down=linear(HIDDEN, INTER),
        norm_final=norm(),
        lm_head=linear(VOCAB, HIDDEN),
    )


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float()).to(x.dtype)


def split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of the fused projection, as the model makes them."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    return (
        q.view(tokens, NUM_HEADS, HEAD_DIM),
        k.view(tokens, NUM_KV_HEADS, HEAD_DIM),
        v.view(tokens, NUM_KV_HEADS, HEAD_DIM),
    )


def decode_step(w: Weights, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One decoder layer, the final norm, the head and greedy sampling: every kernel of a decode step."""
    from modelfleet.dataplane.kernels.activation import silu_and_mul
    from modelfleet.dataplane.kernels.decode_attention import decode_attention
    from modelfleet.dataplane.kernels.gemv import gemv
    from modelfleet.dataplane.kernels.rms_norm import rms_norm
    from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv
    from modelfleet.dataplane.kernels.sampling import sample_tokens

    x = inputs["x"]
    s: dict[str, torch.Tensor] = {}
    s["normed_in"] = rms_norm(x, w.norm_in, EPS)
    s["qkv"] = gemv(s["normed_in"], w.qkv)
    q, k, v = split_qkv(s["qkv"])
    s["q_rot"], s["k_rot"] = rotary_and_write_kv(
        q, k, v, inputs["cos"], inputs["sin"], inputs["kv_cache"], inputs["slots"]
    )
    s["attn"] = decode_attention(
        s["q_rot"],
        inputs["kv_cache"],
        inputs["query_start_loc"],
        inputs["seq_lens"],
        inputs["block_tables"],
        HEAD_DIM**-0.5,
    )
    s["o"] = gemv(s["attn"].view(x.shape[0], -1), w.o)
    s["normed_post"], s["resid"] = rms_norm(s["o"], w.norm_post, EPS, residual=x)
    s["gate_up"] = gemv(s["normed_post"], w.gate_up)
    s["act"] = silu_and_mul(s["gate_up"])
    s["down"] = gemv(s["act"], w.down)
    s["normed_final"], s["resid_final"] = rms_norm(s["down"], w.norm_final, EPS, residual=s["resid"])
    s["logits"] = gemv(s["normed_final"], w.lm_head)
    s["tokens"], s["nan_rows"] = sample_tokens(s["logits"], inputs["temperature"], inputs["seeds"])
    return s


def check_each_stage(w: Weights, inputs: dict[str, torch.Tensor], s: dict[str, torch.Tensor]) -> None:
    """Each stage against the reference of its inputs as the graph left them (not of a reference chain:
    rounding differences would compound, and a stale read must fail at the stage that made it)."""
    tol = TOLERANCES[DTYPE]
    x = inputs["x"]
    torch.testing.assert_close(s["normed_in"], rms_norm_native(x, w.norm_in, EPS), **tol)
    torch.testing.assert_close(s["qkv"], linear_ref(s["normed_in"], w.qkv), **tol)
    q, k, v = split_qkv(s["qkv"])
    want_q, want_k = rotary_embedding_native(q, k, inputs["cos"], inputs["sin"])
    torch.testing.assert_close(s["q_rot"], want_q, **tol)
    torch.testing.assert_close(s["k_rot"], want_k, **tol)
    cache = inputs["kv_cache"].view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(cache[0][inputs["slots"]], s["k_rot"])
    assert torch.equal(cache[1][inputs["slots"]], v)
    want_attn = paged_attention_native(
        s["q_rot"],
        inputs["kv_cache"],
        inputs["query_start_loc"],
        inputs["seq_lens"],
        inputs["block_tables"],
        HEAD_DIM**-0.5,
    )
    torch.testing.assert_close(s["attn"], want_attn, **tol)
    torch.testing.assert_close(s["o"], linear_ref(s["attn"].view(x.shape[0], -1), w.o), **tol)
    want_normed, want_resid = rms_norm_native(s["o"], w.norm_post, EPS, x)
    torch.testing.assert_close(s["resid"], want_resid, atol=0, rtol=0)
    torch.testing.assert_close(s["normed_post"], want_normed, **tol)
    torch.testing.assert_close(s["gate_up"], linear_ref(s["normed_post"], w.gate_up), **tol)
    torch.testing.assert_close(s["act"], silu_and_mul_native(s["gate_up"]), **tol)
    torch.testing.assert_close(s["down"], linear_ref(s["act"], w.down), **tol)
    want_normed, want_resid = rms_norm_native(s["down"], w.norm_final, EPS, s["resid"])
    torch.testing.assert_close(s["resid_final"], want_resid, atol=0, rtol=0)
    torch.testing.assert_close(s["normed_final"], want_normed, **tol)
    torch.testing.assert_close(s["logits"], linear_ref(s["normed_final"], w.lm_head), **tol)
    assert torch.equal(s["tokens"], s["logits"].argmax(dim=-1))  # greedy: the first index of the max
    assert not s["nan_rows"].any()


def fresh_inputs(inputs: dict[str, torch.Tensor], inv_freq: torch.Tensor) -> None:
    """New hidden states and rotary angles, written into the graph's static input buffers."""
    tokens = inputs["x"].shape[0]
    inputs["x"].copy_(torch.randn(tokens, HIDDEN, device=inputs["x"].device).to(DTYPE))
    positions = torch.randint(0, 8192, (tokens,), device=inv_freq.device)
    cos, sin = rope_cos_sin(inv_freq, positions, DTYPE)
    inputs["cos"].copy_(cos)
    inputs["sin"].copy_(sin)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[300], [37, 1500]])
def test_decode_kernels_chained_in_a_cuda_graph_match_their_references(device, seq_lens):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    tokens = len(seq_lens)
    batch = random_paged_batch(
        seq_lens,
        [1] * tokens,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        dtype=DTYPE,
        device=device,
    )
    # each token's K/V goes to its sequence's last position, which the attention then reads
    last = torch.tensor(seq_lens, device=device) - 1
    blocks = batch.block_tables.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    inputs = {
        "x": torch.empty(tokens, HIDDEN, device=device, dtype=DTYPE),
        "cos": torch.empty(tokens, HEAD_DIM // 2, device=device, dtype=DTYPE),
        "sin": torch.empty(tokens, HEAD_DIM // 2, device=device, dtype=DTYPE),
        "kv_cache": batch.kv_cache,
        "slots": blocks * BLOCK_SIZE + last % BLOCK_SIZE,
        "query_start_loc": batch.query_start_loc,
        "seq_lens": batch.seq_lens,
        "block_tables": batch.block_tables,
        "temperature": torch.zeros(tokens, device=device),
        "seeds": torch.arange(tokens, device=device),
    }
    w = random_weights(device)
    fresh_inputs(inputs, inv_freq)
    check_each_stage(w, inputs, decode_step(w, inputs))  # eager (also compiles every kernel)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stages = decode_step(w, inputs)
    for _ in range(REPLAYS):
        fresh_inputs(inputs, inv_freq)
        graph.replay()
        torch.cuda.synchronize()
        check_each_stage(w, inputs, stages)


def test_pdl_is_off_where_unsupported_or_switched_off(monkeypatch):
    """No PDL on the CPU; MODELFLEET_PDL=0 turns it off before the device is even asked."""
    availability._pdl_allowed_by_env.cache_clear()
    availability.pdl_supported.cache_clear()
    try:
        assert not availability.pdl_supported(torch.device("cpu"))
        for value in ("0", "off", "False"):
            monkeypatch.setenv(availability.PDL_ENV, value)
            availability._pdl_allowed_by_env.cache_clear()
            availability.pdl_supported.cache_clear()
            assert not availability.pdl_supported(torch.device("cuda"))
        monkeypatch.setenv(availability.PDL_ENV, "1")
        availability._pdl_allowed_by_env.cache_clear()
        assert availability._pdl_allowed_by_env()
    finally:
        monkeypatch.undo()
        availability._pdl_allowed_by_env.cache_clear()
        availability.pdl_supported.cache_clear()
