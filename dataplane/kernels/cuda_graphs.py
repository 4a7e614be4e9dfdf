"""CUDA graphs for decode steps: capture a forward once per batch size, then replay it.

A decode step launches hundreds of small kernels whose launch cost exceeds their run time at small
batches; a replayed graph launches them all at once. A graph replays fixed addresses and shapes, so the
runner owns static input buffers (first dimension sized for the largest batch); a step copies its inputs
into their leading rows, pads the batch up to the nearest captured size, and replays. Padding rows take
each buffer's pad value (e.g. slot -1: no KV write; sequence length 0: no attention).

    runner = DecodeGraphRunner(forward, buffers, batch_sizes=[1, 2, 4, 8, 16, 32], pad_values={...})
    runner.capture()
    hidden = runner.run({"input_ids": ids, ...}, batch_size=n)   # a view of the graph's output

Inputs may be device tensors or host data (numpy arrays, CPU tensors); host data is staged through
pinned memory and copied asynchronously, so a step never waits for the GPU to drain. On CUDA the buffers
live in one allocation (the largest last) mirrored by one pinned staging area: a step writes its host
inputs there with numpy and sends them in one copy, where two torch copies per buffer took 10-15 us of
host time each (torch.profiler, H200 host).

`forward(views)` gets each buffer cut to the padded batch (buffers with extra leading rows, like
query_start_loc's B+1, keep that extra). With a `head(views, output)` (e.g. the logits and the sampler
after the model's hidden states) each batch size gets a second graph, forward and head in one, which
`run(..., head=True)` replays: the step's work past the forward then costs no launch of its own (the
1B preset's batch-1 step: 1.27 -> 0.32 ms of host time, H200). Buffers not named in run()'s inputs keep
their contents (e.g. a query_start_loc fixed at 0, 1, 2, ...). The output of run() lives in graph
memory: read it before the next run(). Without CUDA, or for batches over the largest captured size,
`forward` runs eagerly on the inputs plus `static_inputs(batch_size)` (what the kept buffers would hold
for that batch).
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from modelfleet.dataplane.kernels.host_signal import MaskReady
    from modelfleet.dataplane.kernels.sampling import TokenBitmask

logger = logging.getLogger(__name__)

Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]
# (views, forward's output[, mask, what brings the mask in]) -> the step's sampled rows
Head = Callable[..., torch.Tensor]


class DecodeGraphRunner:
    def __init__(
        self,
        forward: Forward,
        buffers: Mapping[str, torch.Tensor],
        batch_sizes: Sequence[int],
        *,
        pad_values: Mapping[str, int | float] | None = None,
        static_inputs: Callable[[int], dict[str, torch.Tensor]] | None = None,
        head: Head | None = None,
        enabled: bool = True,
        warmup_runs: int = 2,
    ) -> None:
        if not buffers:
            raise ValueError("DecodeGraphRunner: buffers is empty; give the forward's static inputs")
        self.forward = forward
        self.head = head
        self.buffers = dict(buffers)
        self.max_batch = max(batch_sizes, default=0)
        # rows a buffer has beyond the batch (query_start_loc: 1); the same for every batch size
        self.extra_rows = {name: buf.shape[0] - self.max_batch for name, buf in self.buffers.items()}
        bad = [name for name, extra in self.extra_rows.items() if extra < 0]
        if bad:
            raise ValueError(f"DecodeGraphRunner: buffers {bad} have fewer rows than the largest batch size")
        self.batch_sizes = sorted(set(batch_sizes))
        self.pad_values = dict(pad_values or {})
        self.static_inputs = static_inputs
        device = next(iter(self.buffers.values())).device
        self.enabled = enabled and device.type == "cuda" and torch.cuda.is_available()
        self.warmup_runs = warmup_runs
        # by (batch size, whether the head is in the graph)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None
        # the buffers in one device allocation and its pinned host mirror (host inputs reach the GPU in
        # one copy, without blocking the host)
        self.packing: PackedBuffers | None = None
        # buffers a device input wrote last: their mirror is stale, and a copy of it must go around them
        self.stale: set[str] = set()
        self.staged = torch.cuda.Event() if self.enabled else None
        if self.enabled:
            self.packing = PackedBuffers(self.buffers)
            self.buffers = self.packing.device_views

    def views(self, batch_size: int) -> dict[str, torch.Tensor]:
        return {name: buf[: batch_size + self.extra_rows[name]] for name, buf in self.buffers.items()}

    def _call(self, views: dict[str, torch.Tensor], head: bool) -> torch.Tensor:
        output = self.forward(views)
        if head:
            assert self.head is not None  # asked for only where the runner has one
            output = self.head(views, output)
        return output

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size (two with a head), largest first, all sharing one memory pool."""
        if not self.enabled:
            return
        variants = (False, True) if self.head is not None else (False,)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch_size in reversed(self.batch_sizes):
                views = self.views(batch_size)
                for head in variants:
                    for _ in range(self.warmup_runs):  # compiles kernels, settles allocator and autotuning
                        self._call(views, head)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self.outputs[batch_size, head] = self._call(views, head)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[batch_size, head] = graph
        torch.cuda.current_stream().wait_stream(stream)
        logger.info(
            "captured CUDA graphs for decode batch sizes %s%s",
            self.batch_sizes,
            " (with and without the head)" if self.head is not None else "",
        )

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured batch size that holds batch_size, or None."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[i] if i < len(self.batch_sizes) and self.graphs else None

    def run(
        self, inputs: Mapping[str, torch.Tensor | np.ndarray], batch_size: int, *, head: bool = False
    ) -> torch.Tensor:
        """inputs: name -> tensor or numpy array with batch_size (+ that buffer's extra) rows; returns the
        output rows of the real batch (the head's, with head=True). Trailing dims may be smaller than the
        buffer's (e.g. a narrower block table). Host inputs (numpy, CPU tensors) go through pinned memory:
        no host sync."""
        if head and self.head is None:
            raise ValueError("DecodeGraphRunner: run(head=True) needs a runner made with a head")
        tensors = {name: torch.as_tensor(value) for name, value in inputs.items()}
        padded = self.padded_size(batch_size) if self.enabled else None
        if padded is None:
            return self._call(self._eager_inputs(tensors, batch_size), head)
        packing = self.packing
        assert packing is not None and self.staged is not None  # made with the graphs (enabled)
        host = {name: t for name, t in tensors.items() if t.device.type == "cpu"}
        if host:
            self.staged.synchronize()  # the previous step's copy out of the staging area is done
            for name, value in host.items():
                self._fill(packing.host_views[name], value, batch_size, padded, name)
            # one copy: every buffer in full but the last (the largest), of which the rows in use; around
            # the buffers whose mirror is stale and that no host input refreshed (they keep their contents)
            stale = self.stale - host.keys()
            packing.send(padded + self.extra_rows[packing.last], skip=stale)
            self.stale = stale
        for name, value in tensors.items():
            if value.device.type != "cpu":
                self._fill(self.buffers[name], value, batch_size, padded, name)
                self.stale.add(name)
        self.staged.record()
        self.graphs[padded, head].replay()
        return self.outputs[padded, head][:batch_size]

    def _fill(
        self, dst: torch.Tensor | np.ndarray, value: torch.Tensor, batch_size: int, padded: int, name: str
    ) -> None:
        """value into dst's leading rows (and columns), the padding rows up to `padded` set to the pad."""
        rows, end = batch_size + self.extra_rows[name], padded + self.extra_rows[name]
        index = (slice(0, rows), *(slice(0, n) for n in value.shape[1:]))
        if isinstance(dst, np.ndarray):
            dst[index] = value.numpy()
        else:
            dst[index].copy_(value, non_blocking=True)
        if end > rows:
            dst[rows:end] = self.pad_values.get(name, 0)

    def _eager_inputs(self, inputs: Mapping[str, torch.Tensor], batch_size: int) -> dict[str, torch.Tensor]:
        """The given inputs (on the buffers' device, in their dtype) plus the kept ones: from
        `static_inputs`, else the buffers' leading rows."""
        full = dict(self.static_inputs(batch_size)) if self.static_inputs else {}
        for name, value in inputs.items():
            buf = self.buffers[name]
            full[name] = value.to(device=buf.device, dtype=buf.dtype, non_blocking=True)
        for name, buf in self.buffers.items():
            if name in full:
                continue
            rows = batch_size + self.extra_rows[name]
            if rows > buf.shape[0]:
                raise ValueError(
                    f"DecodeGraphRunner: input {name!r} is needed for a batch of {batch_size} (over the "
                    f"buffers' {self.max_batch}); pass it to run() or give static_inputs"
                )
            full[name] = buf[:rows]
        return full


class MaskedHeadGraphs:
    """A decode step's sampling head with grammar masks (structured output), as graphs of its own.

    A constrained step replays the runner's forward graph and then, at once, this head's graph: the
    logits of the forward's output, a wait on the device for the grammars' bitmask (kernels/host_signal.py:
    the filler releases it once the bitmask has filled on the host), the copy of the bitmask and its row
    flags from their pinned mirror, and the masked sampling, which reads the temperatures and seeds the
    forward's inputs brought (run's caller gives them to the runner). So the engine thread queues the
    whole step, and the next, without waiting for the fill: the device waits, and only when the fill is
    later than the logits. Eager, the head cost ~1 ms of host time a step at 64 rows (torch.profiler,
    H200), more than the GPU's step; engine alone (64 rows, H200, one call) a constrained step took
    1.32-1.42 ms against plain decoding's 1.22-1.31 waited for on the device, 1.71-1.78 against 1.35-1.37
    launched once the engine thread had the fill's reply. A graph is captured per batch size, all of
    them at start where the engine knows its grammars' vocabulary then (capture_all), else on first use,
    into a memory pool of its own; it reads the forward graph of the same padded size, so `run` must
    follow that forward's replay, before the next one."""

    def __init__(
        self, runner: DecodeGraphRunner, words: int, num_direct: int, far_ids: Sequence[int]
    ) -> None:
        from modelfleet.dataplane.kernels.host_signal import HostSignal

        if runner.head is None or not runner.graphs or "temperature" not in runner.buffers:
            raise ValueError("MaskedHeadGraphs: the runner needs a sampling head and captured graphs")
        self.runner = runner
        self.layout = (words, num_direct, tuple(far_ids))
        device = runner.buffers["temperature"].device
        rows = runner.max_batch
        # The bitmask is the largest input, so the mirror's last: a step copies the rows it has alone. The
        # mirror is shared: a grammar process fills it itself (engine/grammar_process.py).
        self.packing = PackedBuffers(
            {
                "masked_rows": torch.zeros(rows, dtype=torch.int32, device=device),
                "bits": torch.zeros(rows, words, dtype=torch.int32, device=device),
            },
            shared=True,
        )
        self.signal = HostSignal(device)
        self.far_ids = torch.tensor(far_ids, dtype=torch.int32, device=device)
        self.ran = torch.cuda.Event()  # after the replay queued last: its copy out of the mirror is done
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def ready(self, batch_size: int) -> MaskReady:
        """Where the next replay's (for `batch_size` rows) bitmask and row flags go, free to fill (the
        replay before has copied them), and the number that releases its wait: the filler's, to write once
        they have filled. Its graph is captured here if capture_all has not (nothing that can fail is
        left between the fill's start and the replay that waits for it: a number released and never
        waited for would let the next replay's wait pass early)."""
        from modelfleet.dataplane.kernels.host_signal import MaskReady

        padded = self.runner.padded_size(batch_size)
        assert padded is not None  # the forward graph of this size ran
        if padded not in self.graphs:
            self._capture(padded)
        self.ran.synchronize()
        host = self.packing.host_tensors
        return MaskReady(host["bits"], host["masked_rows"], self.signal, self.signal.queued + 1)

    @torch.inference_mode()
    def run(self, batch_size: int) -> torch.Tensor:
        """Queues the head for the forward replayed last (ready() came first); the step's [batch_size, 2]
        (token, NaN flag), in graph memory. Its sampling waits on the device until ready()'s number is
        released."""
        padded = self.runner.padded_size(batch_size)
        assert padded is not None  # the forward graph of this size ran
        self.signal.queue()
        self.graphs[padded].replay()
        self.ran.record()
        return self.outputs[padded][:batch_size]

    def release_all(self) -> None:
        """Releases every wait queued (an engine that stops with a step in flight)."""
        self.signal.release_all()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures the head at each of the forward graphs' batch sizes (largest first, no row masked),
        its kernels compiled by the warm-up runs: ~1 s of Triton compiling, and a capture per batch size
        as the batch grows, that would otherwise stall the engine's every stream at the first constrained
        requests (the first of three 64-stream rounds of bench/serve.py --structured ran at 0.73 of
        plain decoding, the others at 0.89-0.91, H200). The eager sampler's masked path runs the same
        kernel variants (the same logits dtype and bitmask layout)."""
        for padded in reversed(self.runner.batch_sizes):
            if padded not in self.graphs:
                self._capture(padded)
        torch.cuda.current_stream().synchronize()

    def _call(self, padded: int, *, waits: bool) -> torch.Tensor:
        from modelfleet.dataplane.kernels.sampling import TokenBitmask

        runner, packing = self.runner, self.packing
        views = packing.device_views
        bits, flags = views["bits"][:padded], views["masked_rows"][:padded]
        mask = TokenBitmask(bits, self.layout[1], self.far_ids, flags)

        def mask_filled() -> None:
            if waits:
                self.signal.wait()
            packing.send(padded)

        assert runner.head is not None  # checked when made
        return runner.head(runner.views(padded), runner.outputs[padded, False], mask, mask_filled)

    @torch.inference_mode()
    def _capture(self, padded: int) -> torch.cuda.CUDAGraph:
        """Captures the head for `padded` rows. Its warm-up runs read this step's inputs and write what
        the replay then writes again (the step's tokens), so capturing in the middle of serving is safe.
        They do not wait: the numbers belong to the replays (HostSignal compiled its kernel when made)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.runner.warmup_runs):
                self._call(padded, waits=False)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the process may use CUDA meanwhile (copies of outputs)
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                self.outputs[padded] = self._call(padded, waits=True)
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs[padded] = graph
        logger.info("captured the masked sampling head's CUDA graph for decode batch size %d", padded)
        return graph


class PackedBuffers:
    """Buffers moved into one device allocation, each at a 16-byte boundary, the largest last, and a pinned
    host mirror with the same layout: numpy views of the mirror take a step's host inputs, and `send`
    copies them over in one transfer. `shared`: the mirror in memory the engine's helper processes map
    (engine/shared_host.py), for inputs they write."""

    def __init__(self, buffers: Mapping[str, torch.Tensor], shared: bool = False) -> None:
        order = sorted(buffers, key=lambda name: buffers[name].numel() * buffers[name].element_size())
        self.offsets: dict[str, int] = {}
        self.nbytes = {name: buffers[name].numel() * buffers[name].element_size() for name in order}
        size = 0
        for name in order:
            if not buffers[name].is_contiguous():
                raise ValueError(f"DecodeGraphRunner: buffer {name!r} must be contiguous")
            self.offsets[name] = size
            size += -(-self.nbytes[name] // 16) * 16
        self.last = order[-1]
        self.row_bytes = {name: _row_bytes(buffers[name]) for name in order}
        device = buffers[self.last].device
        self.device_bytes = torch.empty(size, dtype=torch.uint8, device=device)
        from modelfleet.dataplane.engine.shared_host import host_bytes

        with torch.inference_mode(False):  # usable from inside and outside inference mode
            self.host_bytes = host_bytes(size, pinned=device.type == "cuda", shared=shared)
        self.device_views: dict[str, torch.Tensor] = {}
        self.host_views: dict[str, np.ndarray] = {}
        self.host_tensors: dict[str, torch.Tensor] = {}  # the same, for writers that take a tensor
        for name in order:
            buf = buffers[name]
            start, end = self.offsets[name], self.offsets[name] + self.nbytes[name]
            view = self.device_bytes[start:end].view(buf.dtype).view(buf.shape)
            view.copy_(buf)
            self.device_views[name] = view
            host = self.host_bytes[start:end].view(buf.dtype).view(buf.shape)
            self.host_tensors[name] = host
            self.host_views[name] = host.numpy()
        self.host_bytes.copy_(self.device_bytes)  # the mirror starts equal (buffers no input overwrites)

    def send(self, last_rows: int, skip: Collection[str] = ()) -> None:
        """Queues the copy of the mirror to the device: all of it up to `last_rows` rows of the last buffer.
        The buffers in `skip` keep their device contents: the copy goes around them."""
        end = self.offsets[self.last] + last_rows * self.row_bytes[self.last]
        start = 0
        for name in sorted(skip, key=self.offsets.__getitem__):
            if self.offsets[name] > start:
                self._copy(start, min(self.offsets[name], end))
            start = self.offsets[name] + self.nbytes[name]
        if end > start:
            self._copy(start, end)

    def _copy(self, start: int, end: int) -> None:
        self.device_bytes[start:end].copy_(self.host_bytes[start:end], non_blocking=True)


def _row_bytes(buf: torch.Tensor) -> int:
    return (buf.numel() // buf.shape[0] if buf.shape[0] else 0) * buf.element_size()


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch_size (and max_batch_size itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    return sorted({*sizes, max_batch_size})


def take_inflight_ids(
    input_ids: torch.Tensor, src_rows: torch.Tensor, sampled_ids: torch.Tensor
) -> torch.Tensor:
    """Input ids with each token still in flight (src_rows >= 0) read from the previous step's sampled
    ids on the device: a step can be launched before the previous one's tokens reach the host."""
    return torch.where(src_rows >= 0, sampled_ids[src_rows.clamp(min=0)], input_ids)


def model_decode_runner(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    sampled_ids: torch.Tensor | None = None,
    *,
    max_batch_size: int,
    max_blocks_per_seq: int,
    batch_sizes: Sequence[int] | None = None,
    sample: bool = False,
    enabled: bool = True,
) -> DecodeGraphRunner:
    """A runner for a CausalLM's decode steps (model(input_ids, positions, kv_caches, metadata)).

    run() takes input_ids, positions, slot_mapping, seq_lens [B] and block_tables [B, <= max_blocks];
    query_start_loc stays 0..B (one token per sequence). With `sampled_ids`, run() also takes src_rows
    [B]: where >= 0, the input id is sampled_ids[src_rows] (see take_inflight_ids). Graphs need an
    attention backend that never reads device data on the host ("triton"); with any other the runner
    runs eagerly.

    With `sample` (and `sampled_ids`), run(..., head=True) also takes temperature (float32) and seeds
    (int64) [B] and ends the step in the graph: the logits and the fused sampler (kernels/sampling.py),
    the tokens written to sampled_ids for the next step. It returns int64 [B, 2]: each row's token and
    whether its logits held a NaN.
    """
    from modelfleet.dataplane.attention.metadata import AttentionMetadata

    device = kv_caches[0].device
    block_size = kv_caches[0].shape[2]
    buffers = {
        "input_ids": torch.zeros(max_batch_size, dtype=torch.long, device=device),
        "positions": torch.zeros(max_batch_size, dtype=torch.long, device=device),
        "slot_mapping": torch.full((max_batch_size,), -1, dtype=torch.long, device=device),
        "query_start_loc": torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.zeros(max_batch_size, dtype=torch.int32, device=device),
        "block_tables": torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device),
    }
    if sampled_ids is not None:
        buffers["src_rows"] = torch.full((max_batch_size,), -1, dtype=torch.long, device=device)
    head = None
    if sample:
        if sampled_ids is None:
            raise ValueError("model_decode_runner: sample needs sampled_ids (where the tokens go)")
        buffers["temperature"] = torch.zeros(max_batch_size, dtype=torch.float32, device=device)
        buffers["seeds"] = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        head = functools.partial(_sample_head, model, sampled_ids)
    # fixed so that the captured launch shapes (e.g. decode's KV splits) suit every later step
    max_seq_len = max_blocks_per_seq * block_size

    def forward(views: dict[str, torch.Tensor]) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=views["block_tables"],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        input_ids = views["input_ids"]
        if sampled_ids is not None:
            input_ids = take_inflight_ids(input_ids, views["src_rows"], sampled_ids)
        return model(input_ids, views["positions"], kv_caches, metadata)

    backend = getattr(getattr(model, "attention_backend", None), "name", None)
    if enabled and backend != "triton":
        logger.info("decode CUDA graphs off: attention backend %r reads device data on the host", backend)
        enabled = False
    return DecodeGraphRunner(
        forward,
        buffers,
        batch_sizes or default_batch_sizes(max_batch_size),
        pad_values={"slot_mapping": -1, "seq_lens": 0, "src_rows": -1},
        static_inputs=lambda n: {"query_start_loc": torch.arange(n + 1, dtype=torch.int32, device=device)},
        head=head,
        enabled=enabled,
    )


def _sample_head(
    model: torch.nn.Module,
    sampled_ids: torch.Tensor,
    views: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    mask: TokenBitmask | None = None,
    mask_filled: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The logits of a decode step's hidden states and their fused sampling (with `mask`, each flagged
    row among what its grammar allows; `mask_filled` queues what brings the mask in, after the logits):
    [B, 2] (token, NaN flag)."""
    from modelfleet.dataplane.kernels.sampling import sample_tokens

    logits = model.compute_logits(hidden, float32=False)
    if mask_filled is not None:
        mask_filled()
    token_ids, nan_rows = sample_tokens(logits, views["temperature"], views["seeds"], mask=mask)
    sampled_ids[: token_ids.shape[0]].copy_(token_ids)
    return torch.stack([token_ids, nan_rows.to(token_ids.dtype)], dim=1)
