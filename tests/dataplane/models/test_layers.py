"""Layers against Hugging Face's own implementations; rope scaling equivalence; the op registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from modelfleet.dataplane.layers import RMSNorm, RotaryEmbedding, SiluAndMul, compute_inv_freq
from modelfleet.dataplane.models.config import ModelConfig
from modelfleet.dataplane.ops import get_op, register_op, registered_ops, unregister_op
from modelfleet.dataplane.registration import register_builtins
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

ROPE_CASES = {
    "default": dict(rope_theta=10000.0),
    "linear": dict(rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=4.0)),
    "llama3": dict(
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}


@pytest.fixture(autouse=True, scope="module")
def builtin_ops() -> None:
    register_builtins()  # what loading a model does first


def hf_llama_config(**kwargs) -> transformers.LlamaConfig:
    base = dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072
    )
    return transformers.LlamaConfig(**{**base, **kwargs})


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_matches_hf_exactly(case):
    hf_cfg = hf_llama_config(**ROPE_CASES[case])
    hf_cfg.architectures = ["LlamaForCausalLM"]
    ours = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert ours.rope.rope_type == case
    rotary = RotaryEmbedding(ours.head_dim, ours.rope)
    hf_rotary = LlamaRotaryEmbedding(hf_cfg)
    assert torch.equal(rotary.inv_freq, hf_rotary.inv_freq)
    if case != "default":
        inv_default, _ = ROPE_INIT_FUNCTIONS[case](hf_cfg)
        assert torch.equal(compute_inv_freq(ours.head_dim, ours.rope), inv_default)
        assert not torch.equal(
            inv_default,
            compute_inv_freq(
                ours.head_dim,
                ModelConfig.from_hf_dict(hf_llama_config(architectures=["LlamaForCausalLM"]).to_dict()).rope,
            ),
        )

    positions = torch.tensor([0, 1, 7, 8191, 8192, 40000, 131071])
    q = torch.randn(len(positions), 4, ours.head_dim)
    k = torch.randn(len(positions), 2, ours.head_dim)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    q_out, k_out = rotary(q, k, cos, sin)
    hf_cos, hf_sin = hf_rotary(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))


def test_old_style_rope_scaling_config_is_read():
    raw = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling=dict(
            type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=1024,
        ),
    )
    rope = ModelConfig.from_hf_dict(raw).rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "llama3",
        500000.0,
        8.0,
        1024,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    x = torch.randn(5, 64).to(dtype)
    residual = torch.randn(5, 64).to(dtype)
    ours = RMSNorm(64, eps=1e-5).to(dtype)
    hf = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        hf.weight.copy_(ours.weight)
        assert torch.equal(ours(x), hf(x))
        normed, new_residual = ours(x, residual)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(normed, hf(residual + x))


def test_silu_and_mul():
    x = torch.randn(3, 10)
    assert torch.equal(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_user_registered_op_is_used_by_the_layer():
    calls = []

    @register_op("rms_norm", "cpu")
    def doubled_rms_norm(x, weight, eps):
        calls.append(x.shape)
        return 2 * get_op("rms_norm", "*")(x, weight, eps)

    try:
        assert registered_ops()[("rms_norm", "cpu")] is doubled_rms_norm
        norm = RMSNorm(8)
        x = torch.randn(2, 8)
        out = norm(x)
        assert calls == [torch.Size([2, 8])]
        assert torch.allclose(out, 2 * RMSNorm.forward_native(x, norm.weight, norm.eps))
    finally:
        unregister_op("rms_norm", "cpu")
    calls.clear()
    norm(x)
    assert calls == []  # back to the reference


def test_user_op_is_used_inside_the_model(tmp_path):
    from model_checkpoints import make_checkpoint
    from modelfleet.dataplane.attention import AttentionMetadata
    from modelfleet.dataplane.models import load_model

    model_dir, _ = make_checkpoint("llama2", tmp_path)
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    seen = []

    @register_op("silu_and_mul", "cpu")
    def counting_silu_and_mul(x):
        seen.append(x.shape[0])
        return get_op("silu_and_mul", "*")(x)

    try:
        cfg = model.config
        kv = [torch.zeros(2, 2, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        meta = AttentionMetadata.build(query_lens=[3], seq_lens=[3], block_tables=[[1]], block_size=4)
        with torch.inference_mode():
            model(torch.tensor([1, 2, 3]), torch.arange(3), kv, meta)
    finally:
        unregister_op("silu_and_mul", "cpu")
    assert seen == [3] * cfg.num_layers


def test_unknown_op_names_known_ones():
    with pytest.raises(KeyError, match="rms_norm"):
        get_op("no_such_op", "cpu")


def test_attention_backend_can_be_swapped(tmp_path):
    from model_checkpoints import make_checkpoint
    from modelfleet.dataplane.attention import AttentionMetadata, get_backend
    from modelfleet.dataplane.attention.torch_paged import TorchPagedAttention
    from modelfleet.dataplane.models import load_model

    class CountingBackend(TorchPagedAttention):
        calls = 0

        def forward(self, query, kv_cache, attn_metadata, scale, **kwargs):
            CountingBackend.calls += 1
            return super().forward(query, kv_cache, attn_metadata, scale, **kwargs)

    model_dir, _ = make_checkpoint("llama2", tmp_path)
    model = load_model(model_dir, device="cpu", dtype=torch.float32, attention_backend="torch")
    assert model.attention_backend.name == get_backend("torch").name
    model.set_attention_backend(CountingBackend())
    cfg = model.config
    kv = [torch.zeros(2, 2, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build(query_lens=[2], seq_lens=[2], block_tables=[[0]], block_size=4)
    with torch.inference_mode():
        model(torch.tensor([1, 2]), torch.arange(2), kv, meta)
    assert CountingBackend.calls == cfg.num_layers
