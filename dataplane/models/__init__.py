"""Models: `load_model(model_dir, device=..., dtype=...)` returns a CausalLM over a paged KV cache.

CausalLM contract (used by the engine's model runner):
  .config: ModelConfig
  .forward(input_ids [T], positions [T], kv_caches: list of [2, num_blocks, block_size, Hkv, D],
           attn_metadata) -> hidden [T, hidden]
  .compute_logits(hidden [N, hidden], *, float32=True) -> logits [N, vocab] (float32, or model dtype)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from modelfleet.dataplane.attention import get_backend
from modelfleet.dataplane.device import attention_backend_name
from modelfleet.dataplane.models.config import (
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    ModelConfig,
    RopeConfig,
    UnsupportedModelError,
)
from modelfleet.dataplane.models.llama import LlamaForCausalLM
from modelfleet.dataplane.models.loader import CheckpointError, load_weights
from modelfleet.dataplane.parallel.sharding import split_heads
from modelfleet.dataplane.quantization import QuantizationError, check_fp8_supported
from modelfleet.dataplane.registration import register_builtins

if TYPE_CHECKING:
    from modelfleet.dataplane.parallel.group import TensorParallelGroup

CausalLM = LlamaForCausalLM  # the one family implemented; others would share its interface

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "ModelConfig",
    "QuantizationError",
    "RopeConfig",
    "UnsupportedModelError",
    "kv_cache_block_bytes",
    "load_model",
    "num_local_kv_heads",
]


def kv_cache_block_bytes(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> int:
    """Bytes of one KV-cache block across all layers: K and V, block_size tokens, every KV head (of
    one rank: each tensor-parallel rank holds its heads' KV)."""
    element = torch.empty((), dtype=dtype).element_size()
    return (
        2
        * config.num_layers
        * block_size
        * num_local_kv_heads(config, tensor_parallel_size)
        * (config.head_dim * element)
    )


def num_local_kv_heads(config: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """KV heads one rank holds."""
    if tensor_parallel_size == 1:
        return config.num_kv_heads
    return split_heads(config.num_heads, config.num_kv_heads, 0, tensor_parallel_size).num_kv_heads


def load_model(
    model_dir: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    attention_backend: str | None = None,
    tp: TensorParallelGroup | None = None,
) -> LlamaForCausalLM:
    """Build the model on the meta device, then take its weights from memory-mapped safetensors (with
    `tp`, this rank's slice of the model and of the weights)."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    config = ModelConfig.from_dir(model_dir)
    if config.quantization is not None and config.quantization.format == "fp8":
        check_fp8_supported(device)  # one clear line at load time rather than at the first request
    register_builtins()  # the engine's start: the built-in attention backends and kernels
    backend = get_backend(attention_backend or attention_backend_name(device))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, tp)
    # A model without lm_head computes its logits from the embeddings (tied, the head not quantized): a
    # tied checkpoint may still carry lm_head.weight, a copy of them, to ignore.
    ignore = {"lm_head.weight"} if model.lm_head is None else set()
    ignore |= model.tensors_held_elsewhere()
    load_weights(model, model_dir, device, dtype, ignore=ignore)
    model.after_load(device)
    model.requires_grad_(False)
    return model.eval()
