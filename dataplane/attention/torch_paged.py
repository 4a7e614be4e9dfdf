"""Paged attention in plain torch: the reference for other backends and the CPU production path.

All sequences of a step are handled at once: queries are padded to [B, max_q], K/V are gathered by
whole blocks through the block tables into [B, L, Hkv, D], and one masked scaled_dot_product_attention
does the rest. Grouped-query heads are handled by folding the query heads of a KV head into the query
axis, so K/V are never repeated. Per-step indices and masks are built once and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from modelfleet.dataplane.attention.backend import AttentionBackend, register_backend
from modelfleet.dataplane.attention.metadata import AttentionMetadata

_CACHE_KEY = "torch_paged"


@dataclass
class _StepPlan:
    """Everything about a step's layout that does not depend on the layer."""

    num_seqs: int
    max_q: int
    no_context: bool  # every sequence starts at position 0 this step (plain prefill)
    pad_index: torch.Tensor  # int64 [T]: row of each token in the padded [B * max_q] layout
    q_pos: torch.Tensor  # int64 [B, max_q]: position of each padded query (padding repeats the last)
    seq_lens: torch.Tensor  # int64 [B]
    q_lens: torch.Tensor  # int64 [B]
    block_index: torch.Tensor | None = None  # int64 [B, num_blocks] of the blocks the step reads
    masks: dict[tuple[str, int | None, int], torch.Tensor] = field(default_factory=dict)


def _plan(meta: AttentionMetadata, num_tokens: int, block_size: int) -> _StepPlan:
    plan = meta.backend_cache.get(_CACHE_KEY)
    if plan is not None:
        return plan
    device = meta.seq_lens.device
    starts = meta.query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    seq_lens = meta.seq_lens.to(torch.int64)
    num_seqs = seq_lens.shape[0]
    max_q = meta.max_query_len
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens)
    token_offset = torch.arange(num_tokens, device=device) - starts[token_seq]
    pad_index = token_seq * max_q + token_offset
    offsets = torch.arange(max_q, device=device)
    q_pos = (seq_lens - q_lens)[:, None] + torch.minimum(offsets[None, :], (q_lens - 1)[:, None])
    num_blocks = -(-meta.max_seq_len // block_size)
    plan = _StepPlan(
        num_seqs=num_seqs,
        max_q=max_q,
        no_context=bool(torch.equal(q_lens, seq_lens)),
        pad_index=pad_index,
        q_pos=q_pos,
        seq_lens=seq_lens,
        q_lens=q_lens,
        block_index=meta.block_tables[:, :num_blocks].to(torch.int64),
    )
    meta.backend_cache[_CACHE_KEY] = plan
    return plan


def _mask(plan: _StepPlan, kind: str, kv_len: int, window: int | None, group: int) -> torch.Tensor:
    """Bool [B, 1, group * max_q, kv_len]: True where a (folded) query row may read a KV position."""
    key = (kind, window, group)
    mask = plan.masks.get(key)
    if mask is not None:
        return mask
    kv_pos = torch.arange(kv_len, device=plan.q_pos.device)
    if kind == "new":  # K/V are this step's tokens, padded like the queries: position = offset
        q_pos = torch.minimum(
            torch.arange(plan.max_q, device=kv_pos.device)[None, :], (plan.q_lens - 1)[:, None]
        )
        limit = plan.q_lens
    else:
        q_pos, limit = plan.q_pos, plan.seq_lens
    allowed = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < limit[:, None, None])
    if window is not None:
        allowed &= kv_pos[None, None, :] > q_pos[:, :, None] - window
    b, max_q = q_pos.shape
    mask = allowed[:, None, None].expand(b, 1, group, max_q, kv_len).reshape(b, 1, group * max_q, kv_len)
    plan.masks[key] = mask
    return mask


@register_backend("torch")
class TorchPagedAttention(AttentionBackend):
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        if bool((slot_mapping < 0).any()):  # negative slots mark padding tokens (e.g. graph batches)
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

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
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        plan = _plan(attn_metadata, num_tokens, block_size)
        b, max_q = plan.num_seqs, plan.max_q

        if plan.no_context and key is not None and value is not None:
            if b == 1 and sliding_window is None:
                return self._single_causal(query, key, value, scale, group)
            # K/V straight from this step's tokens, padded like the queries.
            k = self._pad(key, plan)
            v = self._pad(value, plan)
            mask = _mask(plan, "new", max_q, sliding_window, group)
        else:
            # [B, num_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
            k = kv_cache[0][plan.block_index].flatten(1, 2).transpose(1, 2)
            v = kv_cache[1][plan.block_index].flatten(1, 2).transpose(1, 2)
            mask = _mask(plan, "cache", k.shape[2], sliding_window, group)

        if max_q == 1:  # decode: one token per sequence, no padding, T == B
            q = query.view(b, num_kv_heads, group, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            return out.reshape(num_tokens, num_heads, head_dim)

        # [T, Hq, D] -> [B, max_q, Hkv, G, D] -> [B, Hkv, G * max_q, D]
        q = query.new_zeros(b * max_q, num_heads, head_dim)
        q[plan.pad_index] = query
        q = q.view(b, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(b, num_kv_heads, group * max_q, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out = out.view(b, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(b * max_q, num_heads, head_dim)[plan.pad_index]

    @staticmethod
    def _pad(x: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
        """[T, H, D] -> [B, H, max_q, D] with zero rows after each sequence's tokens."""
        padded = x.new_zeros(plan.num_seqs * plan.max_q, x.shape[1], x.shape[2])
        padded[plan.pad_index] = x
        return padded.view(plan.num_seqs, plan.max_q, x.shape[1], x.shape[2]).transpose(1, 2)

    @staticmethod
    def _single_causal(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, group: int
    ) -> torch.Tensor:
        """One prompt, no cached context: plain causal attention, no mask tensor at all."""
        q = query.transpose(0, 1).unsqueeze(0)
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        return out.squeeze(0).transpose(0, 1)
