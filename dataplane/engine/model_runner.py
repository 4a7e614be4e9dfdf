"""Runs one scheduled step on the model: batch tensors from the scheduler's output, forward, sampling.

The KV cache is allocated once, here, from a byte budget (CPU) or a fraction of the device memory left
after loading the weights (accelerators); nothing is allocated per token.

`launch` queues a step on the device and returns at once; `LaunchedStep.result()` waits for its
sampled tokens. A step may be launched before the previous step's tokens reach the host: an input
token still in flight is read on the device from the previous step's sampled tokens (`sampled_ids`,
at the sequence's `sample_row`).

Tensor parallelism (tensor_parallel_size > 1): this runner is rank 0 and drives one worker process per
other rank (parallel/workers.py), each with a ModelRunner of its own slice of the model and its KV heads.
`launch` sends every rank the step's host arrays before running its own part; the ranks meet in the
model's collectives, in-flight input ids are broadcast from rank 0 (only it samples), and the logits
are gathered from every rank's vocabulary shard. With one rank nothing of this runs.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.device_copy import to_device
from modelfleet.dataplane.engine.sampler import PendingSample, SampledBatch, Sampler
from modelfleet.dataplane.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from modelfleet.dataplane.engine.sequence import Sequence
    from modelfleet.dataplane.engine.structured import GrammarVocab
    from modelfleet.dataplane.kernels.cuda_graphs import DecodeGraphRunner, MaskedHeadGraphs
    from modelfleet.dataplane.kernels.host_signal import MaskReady
    from modelfleet.dataplane.kernels.piecewise_graphs import PiecewiseGraphRunner
    from modelfleet.dataplane.parallel.worker import WorkerLink
    from modelfleet.dataplane.parallel.workers import WorkerGroup

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# A step's host arrays, in _forward's order: input_ids, src_rows, positions, slot_mapping, cu_query,
# seq_lens, block_tables.
StepInputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# What rank 0 sends the other ranks per step: ("step", use_graph, inputs, max_query_len, logit_rows).
StepMessage = tuple[str, bool, StepInputs, int, np.ndarray | None]


@dataclass
class StepResult:
    """Aligned with SchedulerOutput.scheduled: None where the step sampled nothing for a sequence."""

    token_ids: list[int | None]
    logprobs: list[dict[int, float] | None]
    errors: list[str | None]


class LaunchedStep:
    """A step queued on the device; `result()` waits for its sampled tokens (once). `pending`: the end of
    its sampling, left for `finish()` while a grammar's bitmask fills on a worker thread."""

    def __init__(
        self,
        num_seqs: int,
        sampling_rows: list[int],
        sampled: SampledBatch | None,
        pending: Callable[[], SampledBatch] | None = None,
    ) -> None:
        self.num_seqs = num_seqs
        self.sampling_rows = sampling_rows
        self.sampled = sampled
        self._pending = pending

    def finish(self) -> None:
        """Queues the end of the step's sampling, if launch left it pending: before the next step is
        launched. Raises the grammar fill's error (again on each call: a failed step gives no tokens)."""
        if self._pending is not None:
            self.sampled = self._pending()
            self._pending = None

    def result(self) -> StepResult:
        self.finish()
        num_seqs = self.num_seqs
        if self.sampled is None:
            return StepResult([None] * num_seqs, [None] * num_seqs, [None] * num_seqs)
        sampled = self.sampled.result()
        if len(self.sampling_rows) == num_seqs:
            return StepResult(list(sampled.token_ids), sampled.logprobs, sampled.errors)
        token_ids: list[int | None] = [None] * num_seqs
        logprobs: list[dict[int, float] | None] = [None] * num_seqs
        errors: list[str | None] = [None] * num_seqs
        for row, i in enumerate(self.sampling_rows):
            token_ids[i] = sampled.token_ids[row]
            logprobs[i] = sampled.logprobs[row]
            errors[i] = sampled.errors[row]
        return StepResult(token_ids, logprobs, errors)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    from modelfleet.dataplane.device import default_dtype

    # "auto": bf16 where the hardware computes it natively (about 4x float32's matmul speed on an
    # AVX512-BF16 CPU), else float32 on CPUs and fp16 on older GPUs.
    return default_dtype(device) if name == "auto" else _DTYPES[name]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, max_model_len: int | None = None, *, link: WorkerLink | None = None
    ) -> None:
        """`link`: set in a tensor-parallel worker (rank > 0): its group, device and rank 0's pipe."""
        from modelfleet.dataplane.device import resolve_device

        # Rank 0's handle on the other ranks' processes; None with one rank and in the workers.
        self.workers: WorkerGroup | None = None
        # The decode graphs' head for rows a grammar constrains, made on the first such step.
        self.masked_head: MaskedHeadGraphs | None = None
        # The last constrained step's head until it finishes: released at the next launch if it has not.
        self._unfinished_head: MaskReady | None = None
        # Whether the step launched last has its sampling queued on the device (not left to its finish).
        self._tokens_queued = True
        self.tp = None if link is None else link.group
        self.device = resolve_device(config.device) if link is None else link.device
        if link is None and config.tensor_parallel_size > 1:
            from modelfleet.dataplane.parallel.workers import WorkerGroup

            self.workers = WorkerGroup(config, max_model_len, self.device)
            self.tp = self.workers.group
            self.device = self.tp.device  # with its index: rank r runs on GPU (rank 0's + r)
        try:
            self._build(config, max_model_len, link or self.workers)
        except BaseException:
            self.close()
            raise

    def _build(
        self, config: EngineConfig, max_model_len: int | None, peers: WorkerLink | WorkerGroup | None
    ) -> None:
        from modelfleet.dataplane.attention.kv_quant import resolve_kv_cache_dtype
        from modelfleet.dataplane.models import kv_cache_block_bytes, load_model, num_local_kv_heads

        tp_size = config.tensor_parallel_size
        if self.device.type == "cpu":
            from modelfleet.dataplane.device import configure_cpu_threads, cpu_threads

            if tp_size == 1:
                logger.info("CPU threads: %d", configure_cpu_threads())
            else:  # the ranks share the cores
                torch.set_num_threads(max(1, cpu_threads() // tp_size))
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Checked before the weights load: a GPU without fp8 refuses at once.
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        self.model = load_model(config.model, device=self.device, dtype=self.dtype, tp=self.tp)
        self.model_config = self.model.config
        self.max_model_len = max_model_len or self.model_config.max_position_embeddings

        # The cache's element size sets the block count: an fp8 cache holds twice bf16's blocks.
        self.block_bytes = kv_cache_block_bytes(self.model_config, self.block_size, self.kv_dtype, tp_size)
        budget = self._kv_cache_budget(config)
        # Blocks beyond what max_num_seqs sequences of max_model_len tokens can fill would never be used.
        max_useful = config.max_num_seqs * -(-self.max_model_len // self.block_size)
        self.num_blocks = min(budget // self.block_bytes, max_useful)
        if peers is not None:  # every rank holds as many blocks as the tightest one
            self.num_blocks = peers.agree_num_blocks(self.num_blocks)
        if self.num_blocks < 1:
            field = "kv_cache_bytes" if self.device.type == "cpu" else "kv_cache_memory_fraction"
            raise ValueError(
                f"{field}: the KV-cache budget of {budget} bytes holds no block of {self.block_bytes} bytes; "
                "raise it"
            )
        mc = self.model_config
        kv_heads = num_local_kv_heads(mc, tp_size)
        shape = (mc.num_layers, 2, self.num_blocks, self.block_size, kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB (%s, %s); budget %.1f MiB",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.kv_dtype,
            self.device,
            budget / 2**20,
        )
        # Only rank 0 samples.
        self.sampler = Sampler(self.device, seed=config.seed) if self.is_first_rank else None
        # The latest step's sampled tokens, by sampling row: the next step's in-flight input ids.
        self.sampled_ids = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        self.decode_graphs = self._capture_decode_graphs(config)
        # Steps with prompt tokens: captured once the engine has set its token budget (capture_piecewise).
        self.piecewise_graphs: PiecewiseGraphRunner | None = None

    def _capture_decode_graphs(self, config: EngineConfig) -> DecodeGraphRunner | None:
        """CUDA graphs for decode steps of up to max_num_seqs sequences; None off CUDA or with
        enforce_eager (then every step runs the model eagerly)."""
        if self.device.type != "cuda" or config.enforce_eager:
            return None
        from modelfleet.dataplane.kernels.cuda_graphs import model_decode_runner

        model = self.model
        if self.tp is not None:
            from modelfleet.dataplane.parallel.worker import InputIdsFromFirstRank

            model = InputIdsFromFirstRank(self.model, self.tp)
        runner = model_decode_runner(
            model,
            self.kv_caches,
            self.sampled_ids,
            max_batch_size=config.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            # the fused sampler in the graph too, for steps it can sample whole (see _graph_samples)
            sample=self.tp is None and self.sampler is not None and self.sampler.fused,
            enabled=True,
        )
        if not runner.enabled:  # e.g. an attention backend that reads device data on the host
            return None
        with torch.inference_mode():
            runner.capture()
        return runner

    def capture_piecewise(self, max_tokens: int) -> None:
        """Piecewise CUDA graphs for steps of up to `max_tokens` (the engine's token budget) with prompt
        tokens, where decode steps replay graphs, on one rank (the engine asks unless piecewise_graphs is
        off)."""
        if self.decode_graphs is None or self.tp is not None:
            return
        from modelfleet.dataplane.kernels.piecewise_graphs import MAX_GRAPHED_TOKENS, PiecewiseGraphRunner

        runner = PiecewiseGraphRunner(
            self.model,
            self.kv_caches,
            self.sampled_ids,
            max_tokens=min(max_tokens, MAX_GRAPHED_TOKENS),
            max_seqs=self.sampled_ids.shape[0],
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
        )
        try:
            runner.capture()
        except torch.cuda.OutOfMemoryError as exc:  # the KV cache took what the graphs would need
            logger.warning(
                "piecewise CUDA graphs off (%s): steps with prompts run eagerly; lower "
                "kv_cache_memory_fraction or max_num_batched_tokens to have them",
                str(exc).splitlines()[0],
            )
            del runner
            torch.cuda.empty_cache()
            return
        self.piecewise_graphs = runner

    @property
    def is_first_rank(self) -> bool:
        return self.tp is None or self.tp.rank == 0

    @property
    def failure(self) -> str | None:
        """Why the tensor-parallel group can no longer step (a rank died), or None."""
        return None if self.workers is None else self.workers.failure

    def close(self) -> None:
        """Stops the other ranks' processes (nothing to do with one rank); releases any masked sampling
        still waiting for its bitmask, so that the device's queue drains."""
        if self.masked_head is not None:
            self.masked_head.release_all()
        if self.workers is not None:
            self.workers.close()

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _kv_cache_budget(self, config: EngineConfig) -> int:
        """Bytes for the KV cache: the byte budget on the CPU, a share of what the weights left free
        on accelerators."""
        from modelfleet.dataplane.device import memory_info

        if self.device.type == "cpu":
            return config.kv_cache_bytes
        return int(memory_info(self.device).free_bytes * config.kv_cache_memory_fraction)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, end_previous: Callable[[], None] | None = None) -> LaunchedStep:
        """Queues a step's forward and sampling on the device; no wait for the device. `end_previous` ends
        the step launched before (the engine's: it waits for that step's grammar fill and raises its
        error). It is called once this step's forward is queued where that forward reads the step
        before's tokens on the device behind a sampling queued already (a decode graph's: this launch's
        host work then overlaps the fill), else first."""
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = starts + query_lens
        cu_query = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_query[1:])
        num_tokens = int(cu_query[-1])

        if num_tokens == num_seqs:  # one token per sequence: decode steps (and 1-token prefills)
            # (token id, -1) for a token on the host; (0, row in sampled_ids) for one in flight.
            pairs = np.fromiter(
                (
                    (s.seq.token_ids[s.num_computed_tokens], -1)
                    if s.num_computed_tokens < len(s.seq.token_ids)
                    else (0, s.seq.sample_row)
                    for s in scheduled
                ),
                dtype=np.dtype((np.int64, 2)),
                count=num_seqs,
            )
            input_ids, src_rows = pairs[:, 0], pairs[:, 1]
            positions = starts
            seq_index = np.arange(num_seqs)
        else:
            input_ids, src_rows = _flat_input_ids(scheduled, cu_query, num_tokens)
            # Position of each token: its index in the flat batch, shifted to where its sequence starts.
            seq_index = np.repeat(np.arange(num_seqs), query_lens)
            positions = np.arange(num_tokens) - cu_query[seq_index] + starts[seq_index]

        block_tables = _block_tables([s.seq.block_ids for s in scheduled])
        max_blocks = block_tables.shape[1]
        bs = self.block_size
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        graphs = self.decode_graphs
        use_graph = (
            graphs is not None
            and num_tokens == num_seqs
            and num_seqs <= graphs.max_batch
            and max_blocks <= graphs.buffers["block_tables"].shape[1]
        )
        inputs: StepInputs = (input_ids, src_rows, positions, slot_mapping, cu_query, seq_lens, block_tables)
        max_query_len = 1 if num_tokens == num_seqs else int(query_lens.max())
        graph_samples = self.workers is None and use_graph and self._graph_samples(out)
        if not (graph_samples and self._tokens_queued):
            self._end_previous(end_previous)
            end_previous = None
        self._tokens_queued = True  # but where _sample leaves the sampling to the step's finish
        if self.workers is not None:
            return self._launch_parallel(self.workers, out, use_graph, inputs, max_query_len)
        if graph_samples:
            if any(s.seq.grammar is not None for s in out.scheduled):
                return self._launch_graph_masked(out, inputs, end_previous)
            return self._launch_graph_sampled(out, inputs, end_previous)
        hidden = self._forward(use_graph, inputs, max_query_len)
        return self._sample(out, hidden, cu_query)

    def _end_previous(self, end_previous: Callable[[], None] | None) -> None:
        """Ends the step launched before (launch's `end_previous`). A constrained step before that did not
        finish (dropped, or its fill failed) has its masked sampling released: it must not hold this
        step's behind it."""
        try:
            if end_previous is not None:
                end_previous()
        finally:
            if self._unfinished_head is not None:
                self._unfinished_head.release()
                self._unfinished_head = None

    def _graph_samples(self, out: SchedulerOutput) -> bool:
        """Whether the decode graph's sampling head can sample this step: every row samples with a
        temperature alone (greedy included); rows a grammar constrains take the masked head."""
        graphs, sampler = self.decode_graphs, self.sampler
        return (
            graphs is not None
            and graphs.head is not None
            and sampler is not None
            and sampler.fused
            and all(s.samples and s.seq.temperature_only for s in out.scheduled)
        )

    def _launch_graph_masked(
        self, out: SchedulerOutput, inputs: StepInputs, end_previous: Callable[[], None] | None = None
    ) -> LaunchedStep:
        """A decode step with rows a grammar constrains: the forward graph and the masked sampling head's
        graph queued at once, the head's sampling waiting on the device until the filler releases it
        (MaskedHeadGraphs), then the grammars' bitmask begun on the host (their matchers follow the
        previous step's tokens, and the fill starts). `finish` raises the fill's error, if any, before the
        step's tokens are read. A step that fails to launch releases its wait here; one that does not
        finish, at the next launch."""
        sampler = self.sampler
        assert sampler is not None  # checked by _graph_samples
        seqs = [s.seq for s in out.scheduled]
        # The masked head reads the temperatures and seeds from the forward's inputs; the step before's
        # fill ran meanwhile, and its tokens are what this step's grammars follow.
        self._replay_decode_graph(seqs, inputs, end_previous, head=False)
        head = self._masked_head(next(s.grammar.vocab for s in seqs if s.grammar is not None))
        # The head first: a number released belongs to a wait queued (released and never waited for, it
        # would let the next step's wait pass before its fill).
        ready = head.ready(len(seqs))
        pairs = head.run(len(seqs))
        try:
            begun = sampler.begin_masks(seqs, self.model_config.vocab_size, self.device, ready)
            for row, seq in enumerate(seqs):
                seq.sample_row = row
            sampled = sampler.graph_sampled(pairs, seqs)
        except BaseException:  # a step that never finishes must not leave its sampling waiting
            ready.release()
            raise
        masks = sampler.grammar_masks
        self._unfinished_head = ready  # released at the next launch unless this step finishes

        def finish() -> SampledBatch:
            if begun is not None:  # None: every grammar had ended, nothing masked
                masks.wait(begun)
            self._unfinished_head = None
            return sampled

        return LaunchedStep(len(seqs), list(range(len(seqs))), None, finish)

    @property
    def samples_in_graphs(self) -> bool:
        """Whether decode steps replay captured graphs with the sampling head (a GPU's, not enforce_eager)."""
        graphs = self.decode_graphs
        return graphs is not None and graphs.head is not None and bool(graphs.graphs)

    def prepare_structured(self, vocab: GrammarVocab) -> None:
        """Where samples_in_graphs: the masked head for `vocab`, its graphs captured now
        (MaskedHeadGraphs.capture_all) rather than at the first constrained requests."""
        self._masked_head(vocab).capture_all()

    def _masked_head(self, vocab: GrammarVocab) -> MaskedHeadGraphs:
        """The decode graphs' masked sampling head for a grammar vocabulary (one per engine in practice:
        one tokenizer), made on the first constrained decode step."""
        from modelfleet.dataplane.engine.structured import bitmask_layout
        from modelfleet.dataplane.kernels.cuda_graphs import MaskedHeadGraphs

        layout = bitmask_layout(vocab)
        head = self.masked_head
        if head is None or head.layout != layout:
            assert self.decode_graphs is not None  # a graph step asks for it
            head = self.masked_head = MaskedHeadGraphs(self.decode_graphs, *layout)
        return head

    def _launch_graph_sampled(
        self, out: SchedulerOutput, inputs: StepInputs, end_previous: Callable[[], None] | None = None
    ) -> LaunchedStep:
        """A decode step whose forward, logits and sampling are one graph replay."""
        sampler = self.sampler
        assert sampler is not None  # checked by _graph_samples
        seqs = [s.seq for s in out.scheduled]
        pairs = self._replay_decode_graph(seqs, inputs, end_previous, head=True)
        for row, seq in enumerate(seqs):
            seq.sample_row = row
        return LaunchedStep(len(seqs), list(range(len(seqs))), sampler.graph_sampled(pairs, seqs))

    def _replay_decode_graph(
        self, seqs: list[Sequence], inputs: StepInputs, end_previous: Callable[[], None] | None, *, head: bool
    ) -> torch.Tensor:
        """The decode graph replayed on a step's inputs and its rows' temperatures and seeds (with the
        sampling head if `head`), then the step before ended (launch's `end_previous`)."""
        graphs, sampler = self.decode_graphs, self.sampler
        assert graphs is not None and sampler is not None  # checked by _graph_samples
        temperature, seeds = sampler.fused_parameters(seqs)
        graph_inputs = {**_graph_inputs(inputs), "temperature": temperature, "seeds": seeds}
        output = graphs.run(graph_inputs, batch_size=len(seqs), head=head)
        self._end_previous(end_previous)
        return output

    def _launch_parallel(
        self,
        workers: WorkerGroup,
        out: SchedulerOutput,
        use_graph: bool,
        inputs: StepInputs,
        max_query_len: int,
    ) -> LaunchedStep:
        """Rank 0 of several: the other ranks get the step first, then all run it together."""
        if workers.failure is not None:
            raise RuntimeError(f"tensor parallelism: {workers.failure}")
        cu_query = inputs[4]
        sampling_rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        # The hidden rows whose logits are computed (the gather is a collective every rank joins).
        logit_rows = (cu_query[1:][sampling_rows] - 1) if sampling_rows else None
        message: StepMessage = ("step", use_graph, inputs, max_query_len, logit_rows)
        workers.send_step(message)
        try:
            hidden = self._forward(use_graph, inputs, max_query_len)
            return self._sample(out, hidden, cu_query)
        except Exception as exc:  # the ranks are out of step now: none can run another
            workers.step_failed(exc)
            raise

    @torch.inference_mode()
    def execute(self, message: StepMessage) -> None:
        """A worker's part of one step (see _launch_parallel); the logits it helps gather are rank 0's."""
        _, use_graph, inputs, max_query_len, logit_rows = message
        hidden = self._forward(use_graph, inputs, max_query_len)
        if logit_rows is not None:
            index = to_device(logit_rows, self.device)
            self.model.compute_logits(hidden[index], float32=False)

    def _forward(self, use_graph: bool, inputs: StepInputs, max_query_len: int) -> torch.Tensor:
        if use_graph:
            graphs = self.decode_graphs
            assert graphs is not None  # use_graph is set only where the graphs were captured
            # Host arrays go through the runner's pinned buffers: no host sync before the replay.
            # a decode step: one input id per sequence
            return graphs.run(_graph_inputs(inputs), batch_size=len(inputs[0]))
        piecewise = self.piecewise_graphs
        if piecewise is not None and max_query_len > 1:
            padded = piecewise.padded_count(len(inputs[0]))
            if padded is not None:  # else more tokens than the largest captured count
                return piecewise.run(inputs, padded, max_query_len)
        return self._forward_eager(*inputs, max_query_len)

    def _forward_eager(
        self,
        input_ids: np.ndarray,
        src_rows: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        cu_query: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        max_query_len: int,
    ) -> torch.Tensor:
        from modelfleet.dataplane.attention import AttentionMetadata

        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, device),
            query_start_loc=to_device(cu_query.astype(np.int32), device),
            seq_lens=to_device(seq_lens.astype(np.int32), device),
            block_tables=to_device(block_tables, device),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
        )
        ids = to_device(input_ids, device)
        if (src_rows >= 0).any():
            from modelfleet.dataplane.kernels.cuda_graphs import take_inflight_ids

            ids = take_inflight_ids(ids, to_device(src_rows, device), self.sampled_ids)
            if self.tp is not None:  # only rank 0 sampled them
                self.tp.broadcast(ids)
        return self.model(ids, to_device(positions, device), self.kv_caches, metadata)

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor, cu_query: np.ndarray) -> LaunchedStep:
        """Logits of each sampling sequence's last token, then the sampler. `hidden` may live in graph
        memory: it is consumed here, before the next step."""
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        sampling_rows = [i for i, s in enumerate(scheduled) if s.samples]
        if not sampling_rows:
            return LaunchedStep(num_seqs, sampling_rows, None)
        if len(sampling_rows) == num_seqs and hidden.shape[0] == num_seqs:
            last_hidden = hidden  # decode: every row is its sequence's last token
        else:
            last_hidden = hidden[to_device(cu_query[1:][sampling_rows] - 1, self.device)]
        sampler = self.sampler
        if sampler is None:
            raise RuntimeError("only the first tensor-parallel rank samples")
        # The fused sampler reads the model dtype's logits once; the torch sampler converts them itself.
        logits = self.model.compute_logits(last_hidden, float32=not sampler.fused)
        seqs = [scheduled[i].seq for i in sampling_rows]
        # With constrained rows, the sampling ends in LaunchedStep.finish: the engine does its other host
        # work while their grammars' bitmask fills (LLMEngine.step).
        pending = sampler.begin(logits, seqs)
        for row, seq in enumerate(seqs):
            seq.sample_row = row
        finish = functools.partial(self._end_sampling, pending)
        if pending.done:
            return LaunchedStep(num_seqs, sampling_rows, finish())
        self._tokens_queued = False  # until this step's finish: the next forward reads its tokens
        return LaunchedStep(num_seqs, sampling_rows, None, finish)

    @torch.inference_mode()
    def _end_sampling(self, pending: PendingSample) -> SampledBatch:
        """The end of a step's sampling: its tokens, also copied where the next step's inputs read them."""
        sampled = pending.finish()
        self.sampled_ids[: len(sampled.token_ids)].copy_(sampled.token_ids)
        return sampled


def _graph_inputs(inputs: StepInputs) -> dict[str, np.ndarray]:
    """A decode step's inputs by the names of the decode graphs' buffers (query_start_loc stays the
    graphs' own 0..B)."""
    input_ids, src_rows, positions, slot_mapping, _, seq_lens, block_tables = inputs
    return {
        "input_ids": input_ids,
        "src_rows": src_rows,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "seq_lens": seq_lens.astype(np.int32),
        "block_tables": block_tables,
    }


def _flat_input_ids(scheduled: list, cu_query: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The step's tokens, flattened, and for each the row of sampled_ids holding it when it is still in
    flight (-1 otherwise). Only a sequence's newest token can be in flight, and only in a 1-token step."""
    inflight = [i for i, s in enumerate(scheduled) if s.num_computed_tokens >= len(s.seq.token_ids)]
    input_ids = np.fromiter(
        itertools.chain.from_iterable(
            s.seq.token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens] or (0,)
            for s in scheduled
        ),
        dtype=np.int64,
        count=num_tokens,
    )
    src_rows = np.full(num_tokens, -1, dtype=np.int64)
    if inflight:
        src_rows[cu_query[inflight]] = [scheduled[i].seq.sample_row for i in inflight]
    return input_ids, src_rows


def _block_tables(block_lists: list[list[int]]) -> np.ndarray:
    """Rows of block ids padded with 0, filled by one masked assignment rather than a row at a time."""
    num_seqs = len(block_lists)
    lengths = np.fromiter(map(len, block_lists), dtype=np.int64, count=num_seqs)
    max_blocks = int(lengths.max())
    flat = np.fromiter(itertools.chain.from_iterable(block_lists), dtype=np.int32, count=int(lengths.sum()))
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    # Row-major order of the mask's True entries is the order of the flattened lists.
    block_tables[np.arange(max_blocks) < lengths[:, None]] = flat
    return block_tables
