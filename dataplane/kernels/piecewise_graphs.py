"""Piecewise CUDA graphs for steps with prompt tokens: the forward replays from graphs captured per token
count, all of it but attention, which runs eagerly between the pieces.

Run eagerly, such a step is host-bound on a GPU: its ~150 kernel launches through Python took 10-20 ms
of host time for the 1B preset whatever the step carried (2 prompts or 8, 32 decodes or 512), and the
device was done within 0.1 ms of the last launch (bench/mixed_step.py --drain, H200 hosts); in pieces
the launch takes ~2.6 ms. One graph cannot hold the
step: attention's launch grid follows the step's sequences and longest query, which change every step.
The rest of a layer (norms, projections, rotary and the KV-cache write, the MLP) depends on the token
count alone. So the forward is captured in pieces split at each attention call: piece 0 runs from the
embedding to layer 0's attention, piece i from layer i-1's attention to layer i's, the last one to the
final norm. A step pads its tokens up to the nearest captured count (padding tokens write no KV: slot
-1), then replays piece 0, runs layer 0's attention on the step's own metadata, replays piece 1, and so
on: L+1 replays and L attention launches for L layers.

Attention reads its query from, and writes its output to, buffers shared by every layer and count (each
piece copies its query in and reads the output from there), and the last piece leaves the hidden states
in another: so what the pieces allocate is free again once a forward ends, and one memory pool, shared by
every count, is as large as the largest count's forward needs.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from modelfleet.dataplane.attention.backend import AttentionBackend
from modelfleet.dataplane.attention.metadata import AttentionMetadata
from modelfleet.dataplane.kernels.cuda_graphs import PackedBuffers, take_inflight_ids

if TYPE_CHECKING:
    from modelfleet.dataplane.engine.model_runner import StepInputs

logger = logging.getLogger(__name__)

# Larger steps run eagerly: at 8,192 tokens the 1B preset's forward keeps the device busy for longer than
# its launches take.
MAX_GRAPHED_TOKENS = 8192

Attention = Callable[[AttentionMetadata], torch.Tensor]


def default_token_counts(max_tokens: int) -> list[int]:
    """16, 32, ... 512 (powers of two), every 256 up to 2,048, every 512 beyond, and max_tokens itself:
    past 1,024 tokens padding adds at most a quarter to a step's matmuls; below, the launches dominate."""
    counts = [16 << i for i in range(6)] + list(range(768, 2049, 256)) + list(range(2560, max_tokens, 512))
    return sorted({c for c in counts if c < max_tokens} | {max_tokens})


class PiecewiseGraphRunner:
    """Pieces of `model(input_ids, positions, kv_caches, metadata)` for token counts up to max_tokens,
    steps of up to max_seqs sequences and max_blocks_per_seq blocks each. `sampled_ids`: where input ids
    still in flight are read (take_inflight_ids). The model's attention backend must never read device
    data on the host (triton's)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        sampled_ids: torch.Tensor,
        *,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        token_counts: Sequence[int] | None = None,
        warmup_runs: int = 2,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sampled_ids = sampled_ids
        self.block_size = kv_caches[0].shape[2]
        # A step never carries more tokens than its sequences can hold; the warm-up's sequences are that
        # long at most.
        max_tokens = min(max_tokens, max_seqs * max_blocks_per_seq * self.block_size)
        self.token_counts = sorted(token_counts or default_token_counts(max_tokens))
        self.max_tokens = self.token_counts[-1]
        self.warmup_runs = warmup_runs
        device = kv_caches[0].device
        tokens, long, int32 = self.max_tokens, torch.long, torch.int32
        self.packing = PackedBuffers(
            {
                "input_ids": torch.zeros(tokens, dtype=long, device=device),
                "src_rows": torch.full((tokens,), -1, dtype=long, device=device),
                "positions": torch.zeros(tokens, dtype=long, device=device),
                "slot_mapping": torch.full((tokens,), -1, dtype=long, device=device),
                "query_start_loc": torch.zeros(max_seqs + 1, dtype=int32, device=device),
                "seq_lens": torch.zeros(max_seqs, dtype=int32, device=device),
                "block_tables": torch.zeros(max_seqs, max_blocks_per_seq, dtype=int32, device=device),
            }
        )
        self.buffers = self.packing.device_views
        cuda = device.type == "cuda"
        self.staged = torch.cuda.Event() if cuda else None
        # Made on the first forward (their shapes are the model's): attention's query and output, the
        # final hidden states.
        self.query: torch.Tensor | None = None
        self.attn_out: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        # by token count: the pieces' graphs and the attention calls between them
        self.pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], list[Attention]]] = {}
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self._capturing: _Pieces | None = None

    def padded_count(self, num_tokens: int) -> int | None:
        """The smallest captured token count that holds num_tokens, or None."""
        i = bisect.bisect_left(self.token_counts, num_tokens)
        return self.token_counts[i] if i < len(self.token_counts) and self.pieces else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the pieces for every token count, largest first, into one memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream), self.split_attention():
                for count in reversed(self.token_counts):
                    metadata = self.stage(_warmup_inputs(count, self.buffers, self.block_size), count)
                    for _ in range(self.warmup_runs):  # compiles kernels, settles the allocator
                        self.forward(count, metadata)
                    self._capturing = _Pieces(self.pool, stream)
                    self.forward(count, metadata)
                    self.pieces[count] = self._capturing.end()
                    self._capturing = None
        except BaseException:
            if self._capturing is not None:  # leave the stream out of capture mode
                self._capturing.abort()
            self.pieces.clear()
            raise
        finally:
            self._capturing = None
            torch.cuda.current_stream().wait_stream(stream)
        logger.info("captured piecewise CUDA graphs for steps of %s tokens", self.token_counts)

    def run(self, inputs: StepInputs, padded: int, max_query_len: int) -> torch.Tensor:
        """The step's hidden states [num_tokens, hidden], in a buffer the next run overwrites; `padded`:
        the count padded_count found for its tokens."""
        num_tokens = len(inputs[0])
        metadata = self.stage(inputs, padded, max_query_len)
        graphs, attentions = self.pieces[padded]
        for graph, attention in zip(graphs, attentions, strict=False):
            graph.replay()
            attention(metadata)
        graphs[-1].replay()
        assert self.hidden is not None  # made when the pieces were captured
        return self.hidden[:num_tokens]

    def stage(self, inputs: StepInputs, padded: int, max_query_len: int | None = None) -> AttentionMetadata:
        """A step's host arrays into the buffers, its tokens padded to `padded` (padding writes no KV:
        slot -1), in one copy; the step's attention metadata over them (max_query_len: the longest
        query, by default computed)."""
        input_ids, src_rows, positions, slot_mapping, cu_query, seq_lens, block_tables = inputs
        num_tokens, num_seqs = len(input_ids), len(seq_lens)
        host = self.packing.host_views
        if self.staged is not None:
            self.staged.synchronize()  # the previous copy out of the mirror is done
        for name, value, pad in (
            ("input_ids", input_ids, 0),
            ("src_rows", src_rows, -1),
            ("positions", positions, 0),
            ("slot_mapping", slot_mapping, -1),
        ):
            host[name][:num_tokens] = value
            host[name][num_tokens:padded] = pad
        host["query_start_loc"][: num_seqs + 1] = cu_query
        host["seq_lens"][:num_seqs] = seq_lens
        # columns past a row's blocks keep older ids: attention reads no further than a sequence's length
        host["block_tables"][:num_seqs, : block_tables.shape[1]] = block_tables
        # one copy, up to the rows in use of the mirror's last (largest) buffer
        rows = {"query_start_loc": num_seqs + 1, "seq_lens": num_seqs, "block_tables": num_seqs}
        self.packing.send(rows.get(self.packing.last, padded))
        if self.staged is not None:
            self.staged.record()
        if max_query_len is None:
            max_query_len = int(np.diff(cu_query).max())
        buffers = self.buffers
        return AttentionMetadata(
            slot_mapping=buffers["slot_mapping"][:padded],
            query_start_loc=buffers["query_start_loc"][: num_seqs + 1],
            seq_lens=buffers["seq_lens"][:num_seqs],
            block_tables=buffers["block_tables"][:num_seqs],
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
        )

    @contextlib.contextmanager
    def split_attention(self) -> Iterator[None]:
        """The model's attention backend wrapped so that each attention call ends a piece (capturing) or
        runs at once on the shared query and output buffers (otherwise), as the replays run it."""
        backend = self.model.attention_backend
        self.model.set_attention_backend(_SplitAttention(backend, self))
        try:
            yield
        finally:
            self.model.set_attention_backend(backend)

    def forward(self, count: int, metadata: AttentionMetadata) -> None:
        """The model on the buffers' first `count` tokens (within split_attention), its output into
        self.hidden: eager, what a replay computes (the warm-up), or split into pieces (while capturing;
        then `metadata` reaches only the pieces' KV-cache writes)."""
        buffers = self.buffers
        ids = take_inflight_ids(buffers["input_ids"][:count], buffers["src_rows"][:count], self.sampled_ids)
        hidden = self.model(ids, buffers["positions"][:count], self.kv_caches, metadata)
        if self.hidden is None:
            self.hidden = torch.empty(
                self.max_tokens, hidden.shape[1], dtype=hidden.dtype, device=hidden.device
            )
        self.hidden[:count].copy_(hidden)

    def split(self, attention: Attention, metadata: AttentionMetadata) -> None:
        """Where a layer's attention runs: now (warm-up), or between two pieces (capture)."""
        if self._capturing is None:
            attention(metadata)
        else:
            self._capturing.split(attention)

    def attention_buffers(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's query and output buffers cut to `query`'s tokens, made on the first call."""
        if self.query is None:
            shape = (self.max_tokens, *query.shape[1:])
            self.query = torch.empty(shape, dtype=query.dtype, device=query.device)
            # zeros: the padding rows, which attention never writes, reach the next piece finite
            self.attn_out = torch.zeros(shape, dtype=query.dtype, device=query.device)
        assert self.attn_out is not None
        count = query.shape[0]
        return self.query[:count], self.attn_out[:count]


class _Pieces:
    """The graphs of one forward being captured, ended and begun again at each attention call."""

    def __init__(self, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        self.pool = pool
        self.stream = stream  # a capture ends on the stream it began on
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.attentions: list[Attention] = []
        self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.pool)
        self.graphs.append(graph)

    def split(self, attention: Attention) -> None:
        self.graphs[-1].capture_end()
        self.attentions.append(attention)
        self._begin()

    def end(self) -> tuple[list[torch.cuda.CUDAGraph], list[Attention]]:
        self.graphs[-1].capture_end()
        return self.graphs, self.attentions

    def abort(self) -> None:
        """Ends the capture in progress after a failure, whatever it left behind."""
        with torch.cuda.stream(self.stream), contextlib.suppress(RuntimeError):
            self.graphs[-1].capture_end()


class _SplitAttention(AttentionBackend):
    """The model's attention backend while its pieces are warmed up and captured: rotary and the KV-cache
    write run in the piece; attention itself is where the piece ends (PiecewiseGraphRunner.split)."""

    def __init__(self, inner: AttentionBackend, runner: PiecewiseGraphRunner) -> None:
        self.inner = inner
        self.runner = runner
        self.name = inner.name

    # The KV writes run in the piece as the model's backend runs them.
    def write_kv(self, *args: Any, **kwargs: Any) -> None:
        self.inner.write_kv(*args, **kwargs)

    def rope_and_write_kv(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.rope_and_write_kv(*args, **kwargs)

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
        query_buf, out_buf = self.runner.attention_buffers(query)
        query_buf.copy_(query)
        inner = self.inner

        def attention(metadata: AttentionMetadata) -> torch.Tensor:
            return inner.forward(
                query_buf,
                kv_cache,
                metadata,
                scale,
                sliding_window=sliding_window,
                k_scale=k_scale,
                v_scale=v_scale,
                out=out_buf,
            )

        self.runner.split(attention, attn_metadata)
        return out_buf


def _warmup_inputs(count: int, buffers: dict[str, torch.Tensor], block_size: int) -> StepInputs:
    """A step of `count` prompt tokens that writes no KV (slot -1): sequences as long as a block table
    holds, reading block 0."""
    per_seq = min(count, buffers["block_tables"].shape[1] * block_size)
    lengths = np.array([min(per_seq, count - start) for start in range(0, count, per_seq)])
    cu_query = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    blocks = np.zeros((len(lengths), 1), dtype=np.int32)
    none = np.full(count, -1)
    return (np.zeros(count, dtype=np.int64), none, positions, none, cu_query, lengths, blocks)
