"""The Llama family: Llama 2/3.x, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Module names follow the Hugging Face checkpoints except for the fused projections
(`qkv_proj` = q|k|v, `gate_up_proj` = gate|up), which the loader assembles from the parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from modelfleet.dataplane.attention.backend import AttentionBackend
from modelfleet.dataplane.attention.metadata import AttentionMetadata
from modelfleet.dataplane.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul, make_linear
from modelfleet.dataplane.models.config import ModelConfig
from torch import nn


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        self.backend = backend
        quant = config.quantization.format if config.quantization else None
        self.qkv_sizes = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = make_linear(
            config.hidden_size,
            self.qkv_sizes,
            ["q_proj", "k_proj", "v_proj"],
            bias=config.qkv_bias,
            quant_format=quant,
        )
        self.o_proj = make_linear(
            config.q_size, [config.hidden_size], bias=config.o_proj_bias, quant_format=quant
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        rotary: RotaryEmbedding,
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.backend.rope_and_write_kv(q, k, v, rotary, cos, sin, kv_cache, attn_metadata.slot_mapping)
        out = self.backend.forward(
            q, kv_cache, attn_metadata, self.scale, key=k, value=v, sliding_window=self.sliding_window
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        quant = config.quantization.format if config.quantization else None
        self.gate_up_proj = make_linear(
            config.hidden_size,
            [size, size],
            ["gate_proj", "up_proj"],
            bias=config.mlp_bias,
            quant_format=quant,
        )
        self.act = SiluAndMul()
        self.down_proj = make_linear(size, [config.hidden_size], bias=config.mlp_bias, quant_format=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, cos, sin, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """CausalLM over a paged KV cache; see modelfleet.dataplane.models for the contract."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = backend
        self.model = LlamaModel(config, backend)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        # Tied embeddings: the output projection is the embedding matrix, no separate tensor.
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[torch.Tensor],  # one [2, num_blocks, block_size, Hkv, D] per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries; the model has {self.config.num_layers}"
            )
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, self.rotary, cos, sin, kv_cache, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]: float32, or in the model dtype with float32=False
        (for a sampler that reads them once; the matmul is in the model dtype either way, as HF does)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Swap the attention implementation of every layer (e.g. for a graph-captured decode path)."""
        self.attention_backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def after_load(self, device: torch.device) -> None:
        """Recompute the tensors that are derived rather than loaded, on the target device."""
        self.rotary.to_device(device)
