"""Paged attention with the Triton kernels of modelfleet.dataplane.kernels (CUDA and ROCm GPUs).

Decode-only steps (every sequence computes one token) take the split-KV decode kernel; any step with a
longer query (prefill, chunked prefill, prefix-cached prompts, mixed batches) takes the extend kernel.
Neither reads data on the host, so a decode step can be captured in a CUDA graph. Importing this module
needs neither Triton nor a GPU (the kernels load on first use) and registers nothing: `register_builtins`
(modelfleet.dataplane.registration) registers it as "triton" where Triton is installed, and where Triton
can run makes the Triton RMSNorm, rotary and SiLU-and-mul kernels the "cuda" implementations of those
model ops; a model's rotary embedding and KV-cache write then run as one kernel (rope_and_write_kv).
"""

from __future__ import annotations

import torch
from modelfleet.dataplane.attention.backend import AttentionBackend, RotaryFn
from modelfleet.dataplane.attention.metadata import AttentionMetadata
from modelfleet.dataplane.kernels import registry as triton_ops
from modelfleet.dataplane.layers.rotary import RotaryEmbedding
from modelfleet.dataplane.ops import get_op


def _is_triton_rotary(rotary: RotaryFn, device_type: str) -> bool:
    """Whether `rotary` would run the Triton neox rotary kernel, which the fused kernel reproduces: a
    plain RotaryEmbedding (its scaling variants differ only in cos/sin) whose op is not overridden."""
    return type(rotary) is RotaryEmbedding and (
        get_op("rotary_embedding", device_type) is triton_ops.rotary_embedding
    )


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        from modelfleet.dataplane.kernels.kv_write import write_kv

        write_kv(key, value, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def rope_and_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rotary: RotaryFn,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _is_triton_rotary(rotary, query.device.type):
            return super().rope_and_write_kv(
                query, key, value, rotary, cos, sin, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
            )
        from modelfleet.dataplane.kernels.rotary_kv_write import rotary_and_write_kv

        return rotary_and_write_kv(
            query, key, value, cos, sin, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        *,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = attn_metadata
        if meta.max_query_len == 1:
            from modelfleet.dataplane.kernels.decode_attention import decode_attention

            # splits sized for the block table's capacity, which a captured graph keeps fixed
            return decode_attention(
                query,
                kv_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                scale,
                out=out,
                sliding_window=sliding_window,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        from modelfleet.dataplane.kernels.extend_attention import extend_attention

        return extend_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
            out=out,
            sliding_window=sliding_window,
            k_scale=k_scale,
            v_scale=v_scale,
        )
