"""Tiny random-weight Hugging Face checkpoints of each supported architecture, made on the fly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
)

# name -> (config class, model class, extra config)
ARCHITECTURES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama2": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True, mlp_bias=True),
    ),
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
            rope_theta=500000.0,
            tie_word_embeddings=True,
        ),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=7)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    # sliding window on the upper layer only (HF: layers from max_window_layers on)
    "qwen2_window": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    "qwen3_bias": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=16, attention_bias=True, tie_word_embeddings=True),
    ),
}


def make_checkpoint(
    name: str, out_dir: Path, seed: int = 0, **overrides: Any
) -> tuple[Path, torch.nn.Module]:
    """Save a random-weight float32 checkpoint; returns (dir, the HF model in eval mode)."""
    config_cls, model_cls, extra = ARCHITECTURES[name]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger-than-default weights so differences are not hidden in tiny logits
        for param in model.parameters():
            param.normal_(0, 0.1) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir, model
