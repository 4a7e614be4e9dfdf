"""Paged attention in plain torch: the reference for other backends and the CPU production path.

A step's sequences are split into a few groups of similar shape (decodes apart from prompt chunks,
then by length), so padding stays small. Each group is one padded computation: queries padded to
[n, max_q], K/V gathered by whole blocks through the block tables (index_select) into [n, L, Hkv, D],
one masked scaled_dot_product_attention. Grouped-query heads are folded into the query axis, so K/V
are never repeated. Decode groups skip SDPA for two batched matmuls that read the gathered K/V in
place (see TorchPagedAttention._decode_forward). The grouping, gather indices and masks are built
once per step and shared by every layer (AttentionMetadata.backend_cache).
An fp8 cache (kv_quant.py) is emulated: K/V are quantized when written (copied as bytes: torch has no
float8 index_copy on the CPU) and dequantized to the query's dtype after the gather; this step's fresh
K/V take the same round trip, so every path sees what the Triton kernels read from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from modelfleet.dataplane.attention.backend import AttentionBackend
from modelfleet.dataplane.attention.kv_quant import check_scale, dequantize, is_fp8, quantize, round_trip
from modelfleet.dataplane.attention.metadata import AttentionMetadata

_CACHE_KEY = "torch_paged"
# A group keeps growing while its useful work is at least this share of its padded work.
_MIN_EFFICIENCY = 0.6
# Decode groups are cheap to launch and their work is reading K/V, so padding is cut much closer.
_MIN_DECODE_EFFICIENCY = 0.9
# Decode multiplies every query head with every KV head (see _decode_forward): Hkv times the useful
# arithmetic, which is cheaper than SDPA's strided reads only while Hkv is small.
_MAX_KV_HEADS_FOR_DECODE_MATMUL = 8


@dataclass
class _Group:
    """Sequences computed together, padded to the same query length and KV length."""

    fresh: bool  # no cached context: K/V can come straight from this step's tokens
    num_seqs: int
    max_q: int
    num_blocks: int  # KV blocks read per sequence (ceil(max seq_len / block_size))
    token_index: torch.Tensor  # int64 [t]: the group's tokens in the step's [T] order
    pad_index: torch.Tensor  # int64 [t]: where each of those tokens sits in [num_seqs * max_q]
    block_index: torch.Tensor  # int64 [num_seqs * num_blocks]: blocks to gather, row-major
    q_pos: torch.Tensor  # int64 [num_seqs, max_q]; padding rows repeat the sequence's last query
    seq_lens: torch.Tensor  # int64 [num_seqs]
    masks: dict[tuple[int, int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    kv_buffers: torch.Tensor | None = None  # [2, n * num_blocks, block_size * Hkv * D], see gather()
    query_blocks: torch.Tensor | None = None  # [n, Hkv, D, Hkv, G], see _decode_forward()

    def gather(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V blocks of the group, [n * num_blocks, block_size * Hkv * D] each.

        The two output buffers are reused by every layer of the step: a fresh multi-megabyte tensor
        per layer costs more in page faults than the copy itself.
        """
        flat = _as_bytes(kv_cache).view(2, kv_cache.shape[1], -1)
        rows = self.block_index.shape[0]
        if self.kv_buffers is None or self.kv_buffers.dtype != kv_cache.dtype:
            self.kv_buffers = kv_cache.new_empty(2, rows, flat.shape[2])
        buffers = _as_bytes(self.kv_buffers)
        torch.index_select(flat[0], 0, self.block_index, out=buffers[0])
        torch.index_select(flat[1], 0, self.block_index, out=buffers[1])
        return self.kv_buffers[0], self.kv_buffers[1]

    def mask(self, kv_len: int, window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive float mask [n, 1, group * max_q, kv_len]: 0 where a (folded) query row may read."""
        key = (kv_len, window, group, dtype)
        mask = self.masks.get(key)
        if mask is None:
            kv_pos = torch.arange(kv_len, device=self.q_pos.device)[None, None, :]
            q_pos = self.q_pos[:, :, None]
            allowed = (kv_pos <= q_pos) & (kv_pos < self.seq_lens[:, None, None])
            if window is not None:
                allowed &= kv_pos > q_pos - window
            n, max_q = self.q_pos.shape
            allowed = allowed[:, None, None].expand(n, 1, group, max_q, kv_len).reshape(n, 1, -1, kv_len)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, float("-inf"))
            self.masks[key] = mask
        return mask


def _split_by_efficiency(
    seqs: list[int], q_lens: list[int], seq_lens: list[int], min_efficiency: float
) -> list[list[int]]:
    """Greedy over sequences sorted by cost, largest first: start a new group when padding would waste
    more than 1 - min_efficiency of the group's work (work ~ query length x KV length)."""
    order = sorted(seqs, key=lambda s: (q_lens[s] * seq_lens[s], seq_lens[s]), reverse=True)
    groups: list[list[int]] = []
    current: list[int] = []
    useful = max_q = max_kv = 0
    for s in order:
        new_useful = useful + q_lens[s] * seq_lens[s]
        new_max_q, new_max_kv = max(max_q, q_lens[s]), max(max_kv, seq_lens[s])
        if current and new_useful < min_efficiency * (len(current) + 1) * new_max_q * new_max_kv:
            groups.append(current)
            current, new_useful, new_max_q, new_max_kv = [], q_lens[s] * seq_lens[s], q_lens[s], seq_lens[s]
        current.append(s)
        useful, max_q, max_kv = new_useful, new_max_q, new_max_kv
    if current:
        groups.append(current)
    return groups


def _make_group(
    seqs: list[int], fresh: bool, starts: list[int], q_lens: list[int], seq_lens: list[int],
    block_tables: torch.Tensor, block_size: int,
) -> _Group:  # fmt: skip
    device = block_tables.device
    seqs = sorted(seqs)  # step order within the group, so a group of the whole step needs no reordering
    max_q = max(q_lens[s] for s in seqs)
    num_blocks = -(-max(seq_lens[s] for s in seqs) // block_size)
    token_index, pad_index, q_pos = [], [], []
    for row, s in enumerate(seqs):
        token_index.extend(range(starts[s], starts[s] + q_lens[s]))
        pad_index.extend(range(row * max_q, row * max_q + q_lens[s]))
        context = seq_lens[s] - q_lens[s]
        q_pos.append([context + min(j, q_lens[s] - 1) for j in range(max_q)])
    seq_index = torch.tensor(seqs, dtype=torch.int64, device=device)
    return _Group(
        fresh=fresh,
        num_seqs=len(seqs),
        max_q=max_q,
        num_blocks=num_blocks,
        token_index=torch.tensor(token_index, dtype=torch.int64, device=device),
        pad_index=torch.tensor(pad_index, dtype=torch.int64, device=device),
        block_index=block_tables.index_select(0, seq_index)[:, :num_blocks].reshape(-1).to(torch.int64),
        q_pos=torch.tensor(q_pos, dtype=torch.int64, device=device),
        seq_lens=torch.tensor([seq_lens[s] for s in seqs], dtype=torch.int64, device=device),
    )


def _plan(meta: AttentionMetadata, block_size: int) -> list[_Group]:
    groups = meta.backend_cache.get(_CACHE_KEY)
    if groups is not None:
        return groups
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
    kinds: dict[tuple[bool, bool], list[int]] = {}  # (is decode, is fresh) -> sequences
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if q_len > 0:
            kinds.setdefault((q_len == 1, q_len == seq_len), []).append(s)
    groups = [
        _make_group(part, fresh, starts, q_lens, seq_lens, meta.block_tables, block_size)
        for (decode, fresh), seqs in sorted(kinds.items())
        for part in _split_by_efficiency(
            seqs, q_lens, seq_lens, _MIN_DECODE_EFFICIENCY if decode else _MIN_EFFICIENCY
        )
    ]
    meta.backend_cache[_CACHE_KEY] = groups
    return groups


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (the same bytes), for the copies torch implements for no float8 dtype."""
    return x.view(torch.uint8) if is_fp8(x) else x


class TorchPagedAttention(AttentionBackend):
    name = "torch"

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
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        if bool((slot_mapping < 0).any()):  # negative slots mark padding tokens (e.g. graph batches)
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        if is_fp8(kv_cache):
            key = quantize(key, check_scale("k_scale", k_scale))
            value = quantize(value, check_scale("v_scale", v_scale))
        cache = _as_bytes(kv_cache)
        cache[0].view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, _as_bytes(key.to(kv_cache.dtype))
        )
        cache[1].view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, _as_bytes(value.to(kv_cache.dtype))
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
        scales = None
        if is_fp8(kv_cache):
            scales = (check_scale("k_scale", k_scale), check_scale("v_scale", v_scale))
            key = None if key is None else round_trip(key, scales[0])
            value = None if value is None else round_trip(value, scales[1])
        groups = _plan(attn_metadata, kv_cache.shape[2])
        if len(groups) == 1 and groups[0].token_index.shape[0] == query.shape[0]:
            result = self._group_forward(
                groups[0], query, kv_cache, scale, key, value, sliding_window, scales
            )
            return result if out is None else out.copy_(result)
        out = torch.empty_like(query) if out is None else out
        for group in groups:
            q = query.index_select(0, group.token_index)
            k = key.index_select(0, group.token_index) if key is not None and group.fresh else None
            v = value.index_select(0, group.token_index) if value is not None and group.fresh else None
            out.index_copy_(
                0,
                group.token_index,
                self._group_forward(group, q, kv_cache, scale, k, v, sliding_window, scales),
            )
        return out

    def _group_forward(
        self,
        group: _Group,
        query: torch.Tensor,  # [t, Hq, D]: the group's tokens, in group order
        kv_cache: torch.Tensor,
        scale: float,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        window: int | None,
        scales: tuple[float, float] | None = None,  # (k_scale, v_scale) of an fp8 cache
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        heads_per_kv = num_heads // num_kv_heads
        n, max_q = group.num_seqs, group.max_q
        use_new_kv = group.fresh and key is not None and value is not None

        if use_new_kv and n == 1 and window is None:
            # One prompt, no cached context: plain causal attention, no mask at all.
            out = F.scaled_dot_product_attention(
                query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=heads_per_kv > 1,
            )  # fmt: skip
            return out[0].transpose(0, 1)

        if use_new_kv:  # K/V straight from this step's tokens, padded like the queries
            k, v = self._pad(key, group), self._pad(value, group)
        else:  # [n * num_blocks, block_size, Hkv, D] -> [n, Hkv, L, D]
            kv_len = group.num_blocks * block_size
            k, v = group.gather(kv_cache)
            if scales is not None:
                k, v = dequantize(k, scales[0], query.dtype), dequantize(v, scales[1], query.dtype)
            k = k.view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
            v = v.view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
        if max_q == 1 and not use_new_kv and num_kv_heads <= _MAX_KV_HEADS_FOR_DECODE_MATMUL:
            return self._decode_forward(group, query, k, v, scale, window)
        mask = group.mask(k.shape[2], window, heads_per_kv, query.dtype)

        if max_q == 1:  # decodes: one token per sequence, no padding
            q = query.view(n, num_kv_heads, heads_per_kv, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            return out.reshape(num_tokens, num_heads, head_dim)

        # [t, Hq, D] -> [n, max_q, Hkv, G, D] -> [n, Hkv, G * max_q, D]
        q = query.new_zeros(n * max_q, num_heads, head_dim).index_copy_(0, group.pad_index, query)
        q = q.view(n, max_q, num_kv_heads, heads_per_kv, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(n, num_kv_heads, heads_per_kv * max_q, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out = out.view(n, num_kv_heads, heads_per_kv, max_q, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(n * max_q, num_heads, head_dim).index_select(0, group.pad_index)

    @staticmethod
    def _decode_forward(
        group: _Group,
        query: torch.Tensor,  # [n, Hq, D]
        k: torch.Tensor,  # [n, Hkv, L, D], a transposed view of the gathered [n, L, Hkv, D]
        v: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """One query token per sequence, as two plain batched matmuls over the gathered K/V.

        SDPA would read K/V through the strided [n, Hkv, L, D] view (or need a copy into that layout).
        Instead the queries are laid out block-diagonally, [n, Hkv * D, Hq] with zeros where a query head
        meets another group's KV head, so K/V are read once as contiguous [n, L, Hkv * D] matrices; the
        zeros add exactly nothing. The softmax runs in float32; in bf16 the scores come out of the matmul
        rounded to bf16 first, like Hugging Face's eager attention (SDPA keeps them in float32).
        """
        n, num_heads, head_dim = query.shape
        num_kv_heads, kv_len = k.shape[1], k.shape[2]
        heads_per_kv = num_heads // num_kv_heads
        keys = k.transpose(1, 2).reshape(n, kv_len, num_kv_heads * head_dim)  # a view: no copy
        values = v.transpose(1, 2).reshape(n, kv_len, num_kv_heads * head_dim)
        blocks = group.query_blocks
        shape = (n, num_kv_heads, head_dim, num_kv_heads, heads_per_kv)
        if blocks is None or blocks.dtype != query.dtype or blocks.shape != shape:
            # Off-diagonal blocks stay zero for the whole step; each layer rewrites only the diagonal.
            blocks = query.new_zeros(shape)
            group.query_blocks = blocks
        q = query.view(n, num_kv_heads, heads_per_kv, head_dim)
        torch.diagonal(blocks, dim1=1, dim2=3).copy_(q.permute(0, 3, 2, 1))  # [n, D, G, Hkv]
        scores = torch.bmm(blocks.view(n, -1, num_heads).transpose(1, 2), keys.transpose(1, 2))
        mask = group.mask(kv_len, window, 1, torch.float32).view(n, 1, kv_len)
        probs = torch.softmax(scores.float().mul_(scale).add_(mask), dim=-1).to(values.dtype)
        out = torch.bmm(probs, values).view(n, num_kv_heads, heads_per_kv, num_kv_heads, head_dim)
        # Keep each query head's own KV head: the diagonal over the two Hkv axes, [n, G, D, Hkv].
        out = torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2)
        return out.reshape(n, num_heads, head_dim)

    @staticmethod
    def _pad(x: torch.Tensor, group: _Group) -> torch.Tensor:
        """[t, H, D] -> [n, H, max_q, D] with zero rows after each sequence's tokens."""
        padded = x.new_zeros(group.num_seqs * group.max_q, x.shape[1], x.shape[2])
        padded.index_copy_(0, group.pad_index, x)
        return padded.view(group.num_seqs, group.max_q, x.shape[1], x.shape[2]).transpose(1, 2)
