"""Speculative decoding: a proposer guesses a sequence's next tokens, one target forward checks them all.

A verify step runs each speculating sequence over its last token and its k draft tokens (k + 1 query
rows), so the target's logits at every draft position come out of one forward. `verify` keeps the
longest prefix of drafts the target agrees with and adds one token of the target's own at the first
disagreement (or after the last draft):

- greedy rows accept a draft while it is the target's argmax, so the tokens are those of plain decoding;
- sampled rows use rejection sampling: accept draft d with probability min(1, p(d) / q(d)), else draw from
  the residual max(p - q, 0), renormalized; the accepted tokens are distributed exactly as the target's p.
  An n-gram draft is deterministic (q is one-hot), so that is p(d) and p without d.

Proposers: `NgramProposer` looks up the sequence's last tokens earlier in its prompt and output and
proposes what followed them (no model); `DraftProposer` runs a smaller checkpoint with the target's
tokenizer, whose KV cache uses the target's block ids (its own tensor of the same blocks), so preemption,
prefix caching and rollback need no bookkeeping of their own.

Only greedy sequences and those that sample with temperature alone, without a seed, speculate
(`Sequence.speculates`); the others decode one token per step beside them in the same forward.

A verify step whose sequences all decode replays a CUDA graph (`verify_graph_runner`): each sequence's
rows are padded to k + 1, so one graph per batch size serves every such step; steps with prefill chunks
run eagerly. A draft model's one-token forwards replay its own decode graphs; its first forward of a
step (catching up with the target's tokens) runs eagerly.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from modelfleet.dataplane.engine.device_copy import to_device

if TYPE_CHECKING:
    from modelfleet.dataplane.engine.model_runner import ModelRunner
    from modelfleet.dataplane.engine.scheduler import ScheduledSequence
    from modelfleet.dataplane.kernels.cuda_graphs import DecodeGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class Drafts:
    """A step's proposals, aligned with the scheduled sequences: token ids (empty where none), and
    for a draft model that sampled them, each sequence's draft probabilities [k, vocab] (None: one-hot)."""

    token_ids: list[list[int]]
    probs: list[torch.Tensor | None]


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from max_n down to min_n), in its prompt and output. A match close to the end is read on into
    the drafts themselves, so a loop shorter than k tokens is drafted for k tokens."""

    def __init__(self, num_tokens: int, *, min_n: int = 1, max_n: int = 3) -> None:
        self.num_tokens = num_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        num = len(token_ids)
        max_n = min(self.max_n, num - 1)
        # Earlier occurrences of the last token, latest first (list.index runs in C); the longest
        # n-gram match wins, the latest among equals.
        backwards = token_ids[::-1]
        best_n, best_end, i = 0, -1, 0
        while best_n < max_n:
            try:
                i = backwards.index(backwards[0], i + 1)
            except ValueError:
                break
            end = num - 1 - i
            n = 1
            while n < max_n and end - n >= 0 and token_ids[end - n] == backwards[n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
        if best_n < self.min_n:
            return []
        drafts: list[int] = []
        for index in range(best_end + 1, best_end + 1 + k):
            drafts.append(token_ids[index] if index < num else drafts[index - num])
        return drafts

    def propose_all(self, scheduled: list[ScheduledSequence], **_: object) -> Drafts:
        token_ids = [
            self.propose(s.seq.token_ids, s.num_lookahead) if s.num_lookahead else [] for s in scheduled
        ]
        return Drafts(token_ids, [None] * len(scheduled))


def verify(
    logits: torch.Tensor,
    draft_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    temperatures: list[float],
    generator: torch.Generator,
) -> list[list[int]]:
    """Each sequence's new tokens: its accepted drafts, then one token of the target's own.
    logits: [sum(k_i + 1), vocab], sequence i's k_i + 1 rows in order; temperature 0 means greedy."""
    device = logits.device
    counts = [len(d) + 1 for d in draft_ids]
    num_rows = sum(counts)
    vocab = logits.shape[1]
    temps = torch.tensor(
        list(itertools.chain.from_iterable([t] * c for t, c in zip(temperatures, counts, strict=True))),
        dtype=torch.float32,
    ).to(device)
    greedy = temps == 0
    # The draft token each row checks; the last row of a sequence checks none (-1 -> column 0, unused).
    targets = np.full(num_rows, -1, dtype=np.int64)
    row = 0
    for d, c in zip(draft_ids, counts, strict=True):
        targets[row : row + c - 1] = d
        row += c
    has_draft = torch.from_numpy(targets >= 0).to(device)
    target_cols = torch.from_numpy(np.maximum(targets, 0)).to(device)

    logits = logits.float()
    argmax = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):  # greedy only: no distributions needed
        return _accepted(draft_ids, (has_draft & (argmax == target_cols)).tolist(), argmax.tolist())
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)
    # q: the draft's probabilities on its rows (one-hot for a deterministic draft), 0 on bonus rows.
    q = torch.zeros_like(probs)
    q[has_draft.nonzero().squeeze(1), target_cols[has_draft]] = 1.0
    row = 0
    for d, dp, c in zip(draft_ids, draft_probs, counts, strict=True):
        if dp is not None and d:
            q[row : row + c - 1] = dp.float()
        row += c
    p_draft = probs.gather(1, target_cols.unsqueeze(1)).squeeze(1)
    q_draft = q.gather(1, target_cols.unsqueeze(1)).squeeze(1)
    uniform = torch.rand(num_rows, generator=generator, device=device)
    accept_sampled = uniform * q_draft < p_draft  # u < p/q without dividing by a zero q
    accept = has_draft & torch.where(greedy, argmax == target_cols, accept_sampled)

    # The token taken where a row's draft is rejected (or on the bonus row): argmax, or a draw from the
    # residual max(p - q, 0) (p itself on the bonus row, where q is 0). Exponential race: argmax(r / E).
    residual = (probs - q).clamp_min_(0.0)
    empty = residual.sum(dim=-1) <= 0  # p == q: any draw from p will do (never taken: that accepts)
    residual = torch.where(empty.unsqueeze(1), probs, residual)
    noise = torch.empty(num_rows, vocab, device=device).exponential_(generator=generator)
    sampled = (residual / noise).argmax(dim=-1)
    fallback = torch.where(greedy, argmax, sampled)

    return _accepted(draft_ids, accept.tolist(), fallback.tolist())


def _accepted(draft_ids: list[list[int]], accept: list[bool], fallback: list[int]) -> list[list[int]]:
    """Per sequence: its drafts up to the first rejected one, then the token of that row (or of the
    row after the last draft)."""
    new_tokens: list[list[int]] = []
    row = 0
    for d in draft_ids:
        num_accepted = 0
        while num_accepted < len(d) and accept[row + num_accepted]:
            num_accepted += 1
        new_tokens.append([*d[:num_accepted], fallback[row + num_accepted]])
        row += len(d) + 1
    return new_tokens


class DraftProposer:
    """A smaller model with the target's vocabulary proposes k tokens per sequence by k forwards of its
    own. Its KV cache has the target's blocks (same ids, same block size): the draft writes a token's
    keys and values into the slot where the target writes its own, so a prefix-cache hit, a preemption
    or a rollback of the target's blocks is one of the draft's too. `Sequence.num_draft_computed` counts
    the tokens whose draft KV is in the cache; every step first catches it up with the target's tokens.
    The host KV tier copies the target's blocks only: a block loaded back holds stale draft KV, which
    costs acceptance, never tokens (verification reads the target alone)."""

    def __init__(
        self,
        runner: ModelRunner,
        model_dir: str,
        num_tokens: int,
        generator: torch.Generator,
        *,
        cuda_graphs: bool = True,
    ) -> None:
        from modelfleet.dataplane.models import load_model, num_local_kv_heads

        self.runner = runner
        self.num_tokens = num_tokens
        self.generator = generator
        self.model = load_model(model_dir, device=runner.device, dtype=runner.dtype, tp=None)
        mc = self.model.config
        if mc.vocab_size != runner.model_config.vocab_size:
            raise ValueError(
                f"speculative_draft_model: its vocabulary ({mc.vocab_size} tokens) is not the target's "
                f"({runner.model_config.vocab_size}); a draft model must share the target's tokenizer"
            )
        shape = (
            mc.num_layers,
            2,
            runner.num_blocks,
            runner.block_size,
            num_local_kv_heads(mc, 1),
            mc.head_dim,
        )
        # In the target's cache dtype: the engine split the KV budget between the two by block bytes.
        self.kv_caches = list(torch.zeros(shape, dtype=runner.kv_dtype, device=runner.device).unbind(0))
        # The draft's one-token forwards (all but a step's first) in CUDA graphs, on a GPU.
        self.graphs: DecodeGraphRunner | None = None
        if cuda_graphs and runner.device.type == "cuda":
            self.graphs = self._capture_graphs()

    def _capture_graphs(self) -> DecodeGraphRunner | None:
        from modelfleet.dataplane.kernels.cuda_graphs import model_decode_runner

        runner = self.runner
        graphs = model_decode_runner(
            self.model,
            self.kv_caches,
            max_batch_size=runner.sampled_ids.shape[0],
            max_blocks_per_seq=-(-(runner.max_model_len + self.num_tokens) // runner.block_size),
        )
        return captured(graphs, "the draft model runs")

    @torch.inference_mode()
    def propose_all(self, scheduled: list[ScheduledSequence], *, temperatures: list[float]) -> Drafts:
        runner = self.runner
        num_seqs = len(scheduled)
        # Catch-up: every scheduled sequence's tokens the draft has not seen, up to the step's last real one.
        starts = [min(s.seq.num_draft_computed, s.num_computed_tokens) for s in scheduled]
        ends = [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
        chunks = [s.seq.token_ids[a:b] for s, a, b in zip(scheduled, starts, ends, strict=True)]
        hidden = self._forward(scheduled, chunks, starts)
        cu = np.cumsum([len(c) for c in chunks]) - 1
        speculating = [i for i, s in enumerate(scheduled) if s.num_lookahead and s.samples]
        token_ids: list[list[int]] = [[] for _ in range(num_seqs)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(num_seqs)]
        for i, s in enumerate(scheduled):
            s.seq.num_draft_computed = ends[i]
        if not speculating:
            return Drafts(token_ids, [None] * num_seqs)
        last = hidden[torch.from_numpy(cu[speculating]).to(runner.device)]
        active = speculating
        for j in range(max(scheduled[i].num_lookahead for i in speculating)):
            next_ids = self._sample(last, [temperatures[i] for i in active])
            ids, row_probs = next_ids[0].tolist(), next_ids[1]
            for row, i in enumerate(active):
                token_ids[i].append(ids[row])
                probs[i].append(row_probs[row])
            active = [i for i in active if len(token_ids[i]) < scheduled[i].num_lookahead]
            if not active:
                break
            # One more draft forward over the token just proposed (its KV lands where the target's will).
            sub = [scheduled[i] for i in active]
            positions = [ends[i] + j for i in active]
            hidden = self._forward(sub, [[token_ids[i][-1]] for i in active], positions, decode=True)
            for i in active:
                scheduled[i].seq.num_draft_computed = ends[i] + j + 1
            last = hidden
        return Drafts(token_ids, [torch.stack(p) if p else None for p in probs])

    def _sample(self, hidden: torch.Tensor, temperatures: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.compute_logits(hidden, float32=True)
        temps = torch.tensor(temperatures, dtype=torch.float32).to(logits.device)
        greedy = temps == 0
        probs = torch.softmax(logits / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        ids = torch.where(greedy, logits.argmax(dim=-1), (probs / noise).argmax(dim=-1))
        # A greedy row's draft is deterministic: its q is one-hot, which verify assumes for greedy rows.
        probs = torch.where(
            greedy.unsqueeze(1), torch.nn.functional.one_hot(ids, probs.shape[1]).float(), probs
        )
        return ids, probs

    def _forward(
        self,
        scheduled: list[ScheduledSequence],
        chunks: list[list[int]],
        starts: list[int],
        *,
        decode: bool = False,
    ) -> torch.Tensor:
        inputs = build_inputs([s.seq.block_ids for s in scheduled], chunks, starts, self.runner.block_size)
        graphs = self.graphs
        if decode and graphs is not None and len(chunks) <= graphs.max_batch:
            # Graph memory: the caller reads these rows before the next forward.
            return graphs.run(
                {
                    "input_ids": inputs.input_ids,
                    "positions": inputs.positions,
                    "slot_mapping": inputs.slot_mapping,
                    "seq_lens": inputs.seq_lens.astype(np.int32),
                    "block_tables": inputs.block_tables,
                },
                batch_size=len(chunks),
            )
        return run_model(self.model, self.kv_caches, self.runner.device, inputs)


def captured(graphs: DecodeGraphRunner, what: str) -> DecodeGraphRunner | None:
    """`graphs` once captured; None (run eagerly) where graphs are off or their capture fails."""
    if not graphs.enabled:
        return None
    try:
        with torch.inference_mode():
            graphs.capture()
    except Exception:  # the step still runs, eagerly
        logger.warning("speculative decoding: %s without CUDA graphs", what, exc_info=True)
        return None
    return graphs


@dataclass
class StepInputs:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_query: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    max_query_len: int


def build_inputs(
    block_lists: list[list[int]], chunks: list[list[int]], starts: list[int], block_size: int
) -> StepInputs:
    """A flat batch of each sequence's `chunk` of tokens at positions from `start` on."""
    from modelfleet.dataplane.engine.model_runner import _block_tables

    query_lens = np.array([len(c) for c in chunks], dtype=np.int64)
    cu_query = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_query[1:])
    num_tokens = int(cu_query[-1])
    starts_np = np.array(starts, dtype=np.int64)
    seq_index = np.repeat(np.arange(len(chunks)), query_lens)
    positions = np.arange(num_tokens) - cu_query[seq_index] + starts_np[seq_index]
    block_tables = _block_tables(block_lists)
    slot_mapping = block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
    slot_mapping += positions % block_size
    input_ids = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=num_tokens)
    return StepInputs(
        input_ids,
        positions,
        slot_mapping,
        cu_query,
        starts_np + query_lens,
        block_tables,
        int(query_lens.max()),
    )


def run_model(
    model: torch.nn.Module, kv_caches: list[torch.Tensor], device: torch.device, inputs: StepInputs
) -> torch.Tensor:
    """One eager forward over a flat batch; the hidden states of every token."""
    from modelfleet.dataplane.attention import AttentionMetadata

    metadata = AttentionMetadata(
        slot_mapping=to_device(inputs.slot_mapping, device),
        query_start_loc=to_device(inputs.cu_query.astype(np.int32), device),
        seq_lens=to_device(inputs.seq_lens.astype(np.int32), device),
        block_tables=to_device(inputs.block_tables, device),
        max_query_len=inputs.max_query_len,
        max_seq_len=int(inputs.seq_lens.max()),
    )
    ids, positions = to_device(inputs.input_ids, device), to_device(inputs.positions, device)
    return model(ids, positions, kv_caches, metadata)


@dataclass
class VerifiedStep:
    """A verify step's outcome, aligned with SchedulerOutput.scheduled like a StepResult: a list of new
    tokens for a sequence that speculated, one token for one that decoded as usual, None where nothing
    was sampled or the sequence failed. The forward ran synchronously: `result()` returns at once."""

    token_ids: list[int | list[int] | None]
    logprobs: list[dict[int, float] | None]
    errors: list[str | None]

    def result(self) -> VerifiedStep:
        return self


class Speculator:
    """Proposes drafts, runs the target over them, verifies, and counts what was accepted."""

    def __init__(
        self,
        runner: ModelRunner,
        proposer: str,
        num_tokens: int,
        draft_model: str | None,
        seed: int,
        *,
        cuda_graphs: bool = True,
    ) -> None:
        self.runner = runner
        self.num_tokens = num_tokens
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed(seed)
        self.proposer: NgramProposer | DraftProposer
        if proposer == "draft":
            assert draft_model is not None  # EngineConfig checks it
            self.proposer = DraftProposer(
                runner, draft_model, num_tokens, self.generator, cuda_graphs=cuda_graphs
            )
        else:
            self.proposer = NgramProposer(num_tokens)
        # Decode-only verify steps in CUDA graphs (a GPU with the Triton attention backend), else None.
        self.graphs: DecodeGraphRunner | None = None
        if cuda_graphs and runner.device.type == "cuda":
            self.graphs = self._capture_graphs()
        # Since the engine started: verifications of at least one draft, drafts, and drafts accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def _capture_graphs(self) -> DecodeGraphRunner | None:
        runner = self.runner
        graphs = verify_graph_runner(
            runner.model,
            runner.kv_caches,
            max_batch_size=runner.sampled_ids.shape[0],
            num_tokens_per_seq=self.num_tokens + 1,
            max_blocks_per_seq=-(-(runner.max_model_len + self.num_tokens) // runner.block_size),
        )
        return captured(graphs, "verify steps run")

    def reset_counts(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per verification of drafts: accepted drafts plus the target's own."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSequence]) -> VerifiedStep:
        num_seqs = len(scheduled)
        temperatures = [0.0 if s.seq.params.greedy else s.seq.params.temperature for s in scheduled]
        drafts = self.proposer.propose_all(scheduled, temperatures=temperatures)
        chunks = []
        for s, d in zip(scheduled, drafts.token_ids, strict=True):
            del d[s.num_lookahead :]
            chunks.append(
                s.seq.token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens] + d
            )
        starts = [s.num_computed_tokens for s in scheduled]
        runner = self.runner
        graphs = self.graphs
        if (
            graphs is not None
            and num_seqs <= graphs.max_batch
            and all(s.num_new_tokens == 1 and s.samples for s in scheduled)
        ):
            hidden, ends = self._forward_graph(graphs, scheduled, chunks, starts)
        else:
            inputs = build_inputs([s.seq.block_ids for s in scheduled], chunks, starts, runner.block_size)
            hidden = run_model(runner.model, runner.kv_caches, runner.device, inputs)
            ends = inputs.cu_query[1:]

        token_ids: list[int | list[int] | None] = [None] * num_seqs
        logprobs: list[dict[int, float] | None] = [None] * num_seqs
        errors: list[str | None] = [None] * num_seqs
        verifying = [i for i, s in enumerate(scheduled) if s.samples and s.seq.speculates]
        plain = [i for i, s in enumerate(scheduled) if s.samples and not s.seq.speculates]
        if plain:  # the sampler's own path: penalties, filters, logprobs, seeds
            sampler = runner.sampler
            assert sampler is not None  # rank 0 (speculation runs with one rank)
            index = torch.from_numpy(ends[plain] - 1).to(runner.device)
            logits = runner.model.compute_logits(hidden[index], float32=not sampler.fused)
            sampled = sampler.sample(logits, [scheduled[i].seq for i in plain]).result()
            for row, i in enumerate(plain):
                token_ids[i], logprobs[i], errors[i] = (
                    sampled.token_ids[row],
                    sampled.logprobs[row],
                    sampled.errors[row],
                )
        if verifying:
            rows = np.concatenate(
                [np.arange(ends[i] - len(drafts.token_ids[i]) - 1, ends[i]) for i in verifying]
            )
            logits = runner.model.compute_logits(
                hidden[torch.from_numpy(rows).to(runner.device)], float32=True
            )
            draft_ids = [drafts.token_ids[i] for i in verifying]
            counts = [len(d) + 1 for d in draft_ids]
            bad = torch.isnan(logits).any(dim=1).tolist()
            new_tokens = verify(
                torch.nan_to_num(logits),
                draft_ids,
                [drafts.probs[i] for i in verifying],
                [temperatures[i] for i in verifying],
                self.generator,
            )
            row = 0
            for i, d, c, tokens in zip(verifying, draft_ids, counts, new_tokens, strict=True):
                if any(bad[row : row + c]):
                    errors[i] = "the model produced NaN logits"
                else:
                    token_ids[i] = tokens
                    if d:
                        self.num_drafts += 1
                        self.num_draft_tokens += len(d)
                        self.num_accepted_tokens += len(tokens) - 1
                row += c
        return VerifiedStep(token_ids, logprobs, errors)

    def _forward_graph(
        self,
        graphs: DecodeGraphRunner,
        scheduled: list[ScheduledSequence],
        chunks: list[list[int]],
        starts: list[int],
    ) -> tuple[torch.Tensor, np.ndarray]:
        """A decode-only verify step in a captured graph: each sequence's last token and drafts padded to
        k + 1 rows (a padding row writes no KV and sits at the last real position; its output is not
        read). The hidden states, and where each sequence's real rows end in them."""
        num_seqs, width = len(chunks), self.num_tokens + 1
        lengths = np.array([len(c) for c in chunks], dtype=np.int64)
        starts_np = np.array(starts, dtype=np.int64)
        input_ids = np.zeros((num_seqs, width), dtype=np.int64)
        for i, chunk in enumerate(chunks):
            input_ids[i, : len(chunk)] = chunk
        offsets = np.arange(width)
        real = offsets < lengths[:, None]
        positions = starts_np[:, None] + np.minimum(offsets, lengths[:, None] - 1)
        from modelfleet.dataplane.engine.model_runner import _block_tables

        bs = self.runner.block_size
        block_tables = _block_tables([s.seq.block_ids for s in scheduled])
        # Columns up to the padding rows' positions too: attention reads the table that far.
        num_columns = int((starts_np.max() + width - 1) // bs + 1)
        if num_columns > block_tables.shape[1]:
            block_tables = np.pad(block_tables, ((0, 0), (0, num_columns - block_tables.shape[1])))
        rows = np.repeat(np.arange(num_seqs), width).reshape(num_seqs, width)
        slots = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        slot_mapping = np.where(real, slots, -1)
        seq_lens = (starts_np + width).astype(np.int32)
        hidden = graphs.run(
            {
                "input_ids": input_ids,
                "positions": positions,
                "slot_mapping": slot_mapping,
                "seq_lens": seq_lens,
                "block_tables": block_tables,
            },
            batch_size=num_seqs,
        )
        return hidden.reshape(num_seqs * width, -1), np.arange(num_seqs) * width + lengths


def verify_graph_runner(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    *,
    max_batch_size: int,
    num_tokens_per_seq: int,
    max_blocks_per_seq: int,
    enabled: bool = True,
) -> DecodeGraphRunner:
    """CUDA graphs of verify steps: every sequence has exactly `num_tokens_per_seq` query rows (its last
    token and k drafts, padded), so one graph per batch size serves every decode-only verify step. The
    token inputs are [batch, k + 1] buffers; a padded batch row is a sequence of its own k + 1 tokens
    (no context, no KV writes). The block table holds k positions more than max_model_len: padding rows
    sit past a sequence's last token. Off the Triton attention backend the runner runs eagerly."""
    from modelfleet.dataplane.attention.metadata import AttentionMetadata
    from modelfleet.dataplane.kernels.cuda_graphs import DecodeGraphRunner, default_batch_sizes

    device = kv_caches[0].device
    width = num_tokens_per_seq
    buffers = {
        "input_ids": torch.zeros(max_batch_size, width, dtype=torch.long, device=device),
        "positions": torch.zeros(max_batch_size, width, dtype=torch.long, device=device),
        "slot_mapping": torch.full((max_batch_size, width), -1, dtype=torch.long, device=device),
        "query_start_loc": torch.arange(max_batch_size + 1, dtype=torch.int32, device=device) * width,
        "seq_lens": torch.full((max_batch_size,), width, dtype=torch.int32, device=device),
        "block_tables": torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device),
    }
    max_seq_len = max_blocks_per_seq * kv_caches[0].shape[2]

    def forward(views: dict[str, torch.Tensor]) -> torch.Tensor:
        num_seqs = views["seq_lens"].shape[0]
        metadata = AttentionMetadata(
            slot_mapping=views["slot_mapping"].reshape(-1),
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=views["block_tables"],
            max_query_len=width,
            max_seq_len=max_seq_len,
        )
        hidden = model(views["input_ids"].reshape(-1), views["positions"].reshape(-1), kv_caches, metadata)
        return hidden.reshape(num_seqs, width, -1)

    backend = getattr(getattr(model, "attention_backend", None), "name", None)
    return DecodeGraphRunner(
        forward,
        buffers,
        default_batch_sizes(max_batch_size),
        pad_values={"slot_mapping": -1, "seq_lens": width},
        static_inputs=lambda n: {
            "query_start_loc": torch.arange(n + 1, dtype=torch.int32, device=device) * width
        },
        enabled=enabled and backend == "triton",
    )
