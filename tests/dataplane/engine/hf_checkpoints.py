"""Tiny random-weight Hugging Face checkpoints, one per supported architecture."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Wider than the default so that random logits are peaked: no near-ties for float32 noise to break.
    initializer_range=0.1,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=128
)

ARCHITECTURES = {
    "llama2": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3.1": (
        "LlamaConfig",
        dict(tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0, factor=8.0)),
    ),
    "llama3.2-tied": (
        "LlamaConfig",
        dict(tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0, factor=32.0)),
    ),
    "mistral-sliding-window": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=96)),
    "qwen2-qkv-bias-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-qk-norm": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32)),
}


def make_checkpoint(out_dir: Path, architecture: str, seed: int = 0) -> Path:
    import torch
    import transformers

    config_class, extra = ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The default init leaves biases at 0 and norm weights at 1, which would hide mistakes in their use.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir
