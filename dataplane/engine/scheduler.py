"""Decides, every step, which sequences run and how many tokens of each: continuous batching.

Plain Python, no torch. One step mixes decodes and prefill chunks under a token budget. A step is
planned before the previous step's sampled tokens reach the host: a sequence's token in flight counts
as one of its tokens (the model runner reads it on the device), and `update` later fills it in. Running
sequences go first, in priority order (lower value first, then first come first served); when the KV
cache runs out, the last of them (lowest priority, newest) is preempted: its blocks are freed and it is
recomputed later from its tokens. Waiting requests are admitted in the same order while budget, sequence
slots and blocks last; a waiting request that finds no blocks preempts running ones of lower priority.
With `prefill_wait_steps`, a step of pure decodes admits no waiting request until one has waited that
many steps: requests that arrive one by one then join together, and the steps between stay pure
decodes (whole CUDA graphs in the model runner) instead of each launching a step with prompts (piecewise
graphs, attention eager between them: about three decode steps' launch). A step that
preempted lower-priority requests to make room for the first waiting one admits it at once, and so
does one whose token budget the waiting requests already fill.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from modelfleet.dataplane.engine.block_manager import BlockManager
from modelfleet.dataplane.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    # Tokens already in the KV cache before this step (prefix-cache hits included).
    num_computed_tokens: int
    num_new_tokens: int
    # Whether this step reaches the sequence's last token, so a new token is sampled.
    samples: bool
    # Slots held after the new tokens for draft tokens to verify (speculative decoding), at most.
    num_lookahead: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_speculative_tokens: int = 0,
        prefill_wait_steps: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.prefill_wait_steps = prefill_wait_steps
        self._held_steps = 0  # pure-decode steps planned while requests waited
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # > 0: a decode of a sequence that speculates holds this many more slots for its drafts. The
        # engine then reads every step's tokens back before it plans the next (see LLMEngine.step).
        self.num_speculative_tokens = num_speculative_tokens
        # Both kept sorted by Sequence.sort_key.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request_id: {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        bisect.insort(self.waiting, seq, key=_sort_key)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        made_room = self._make_room_for_priority()

        # Running sequences: decodes and the remaining chunks of their prompts.
        preempted_for_running = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.last_token_in_flight(self.max_model_len):
                i += 1  # `update` finishes it
                continue
            num_new = min(seq.num_tokens_with_inflight - seq.num_computed_tokens, budget)
            lookahead = self._lookahead(seq, num_new, budget)
            if lookahead and not self.block_manager.allocate_slots(seq, num_new + lookahead):
                lookahead = 0  # no blocks for drafts: decode without them rather than preempt
            while not lookahead and not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted_for_running = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self._plan(out, seq, seq.num_computed_tokens, num_new, lookahead)
            budget -= num_new + lookahead
            i += 1

        if self._hold_waiting(out, made_room, budget):
            return out

        # Waiting requests, unless this step already had to free blocks.
        w = 0  # the first waiting request not passed over (its blocks are loading from the host tier)
        while (
            not preempted_for_running
            and w < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[w]
            if seq.num_inflight:
                break  # preempted with a token in flight: recomputed once `update` has it
            if self.block_manager.waits_for_blocks(seq):
                w += 1  # it waits for its copies, out of the batch
                continue
            hit_block_ids, num_hit_tokens = self.block_manager.get_computed_blocks(seq)
            num_new = seq.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(seq, num_new, hit_block_ids):
                break
            self.waiting.pop(w)
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_tokens = num_hit_tokens
            seq.num_computed_tokens = num_hit_tokens
            seq.num_draft_computed = num_hit_tokens  # a draft's KV shares the target's blocks
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            self._plan(out, seq, num_hit_tokens, num_new)
            budget -= num_new

        return out

    def _hold_waiting(self, out: SchedulerOutput, made_room: bool, budget: int) -> bool:
        """Whether this step, so far pure decodes, leaves the waiting requests for a later one (at most
        prefill_wait_steps in a row). A step with prompt tokens in it already admits them, and so does
        one that preempted running requests to make room for the first waiting one (`made_room`), or one
        whose `budget` left the waiting requests fill already (holding would gather nothing more into it)."""
        if not self.prefill_wait_steps or not self.waiting or made_room:
            self._held_steps = 0
            return False
        pure_decodes = bool(out.scheduled) and all(
            s.num_new_tokens == 1 and not s.num_lookahead for s in out.scheduled
        )
        if pure_decodes and self._held_steps < self.prefill_wait_steps and not self._waiting_fill(budget):
            self._held_steps += 1
            return True
        self._held_steps = 0
        return False

    def _waiting_fill(self, budget: int) -> bool:
        """Whether the waiting requests' prompts fill `budget` tokens. (Free sequence slots are no such
        bound: requests finishing while the others are held free more of them.)"""
        for seq in self.waiting:
            budget -= seq.num_tokens - seq.num_computed_tokens
            if budget <= 0:
                return True
        return False

    def _lookahead(self, seq: Sequence, num_new: int, budget: int) -> int:
        """Draft slots for a decode of a sequence that speculates: at most num_speculative_tokens,
        within the step's budget and the tokens the sequence may still produce."""
        k = self.num_speculative_tokens
        if not k or not seq.speculates or seq.num_computed_tokens + num_new != seq.num_tokens_with_inflight:
            return 0
        room = min(
            seq.params.max_tokens - seq.num_output_tokens - seq.num_inflight,
            self.max_model_len - seq.num_tokens_with_inflight,
        )
        return max(0, min(k, budget - num_new, room - 1))

    def _plan(
        self, out: SchedulerOutput, seq: Sequence, num_computed: int, num_new: int, lookahead: int = 0
    ) -> None:
        """Puts the sequence into this step; its computed tokens and tokens in flight count the step
        as done, so that the next step can be planned before this one's tokens are known."""
        samples = num_computed + num_new == seq.num_tokens_with_inflight
        out.scheduled.append(ScheduledSequence(seq, num_computed, num_new, samples, lookahead))
        seq.num_computed_tokens = num_computed + num_new
        if samples:
            seq.num_inflight += 1

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int | list[int] | None]) -> list[Sequence]:
        """Records a step's sampled tokens. `sampled_token_ids` is aligned with `out.scheduled` (None where
        the step sampled nothing, or failed; a list for a verify step's accepted drafts and the target's
        token). Returns the sequences that got a token, finished ones included. A sequence preempted
        since the step was planned still gets its token."""
        updated = []
        now = time.monotonic()
        finished = SequenceStatus.FINISHED
        max_model_len = self.max_model_len
        for item, token_id in zip(out.scheduled, sampled_token_ids, strict=True):
            seq = item.seq
            if seq.status is finished or not item.samples:
                continue
            seq.num_inflight -= 1
            if token_id is None:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            if isinstance(token_id, list):
                self._accept(item, token_id)
            else:
                seq.append_token(token_id)
                reason = seq.check_stop(max_model_len)
                if reason is not None:
                    self.finish(seq.request_id, reason)
            updated.append(seq)
        return updated

    def _accept(self, item: ScheduledSequence, token_ids: list[int]) -> None:
        """A verify step's tokens, up to the first that stops the sequence. The accepted drafts' KV is
        in the cache; the slots of rejected ones are given back (their keys and values are overwritten
        by the tokens that take those positions later, and no block holding them was named for the
        prefix cache: only tokens on the host are)."""
        seq = item.seq
        for token_id in token_ids:
            seq.append_token(token_id)
            reason = seq.check_stop(self.max_model_len)
            if reason is not None:
                self.finish(seq.request_id, reason)
                return
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens + len(token_ids) - 1
            self.block_manager.trim(seq, seq.num_computed_tokens)

    def finish(self, request_id: str, reason: str, error: str | None = None) -> Sequence | None:
        """Ends a request now (stop, length, abort, error) and frees its blocks. None if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finished_time = time.monotonic()
        return seq

    def _make_room_for_priority(self) -> bool:
        """Before anything is planned: if the first waiting request cannot get blocks for its first
        chunk, preempt running requests of strictly lower priority (higher value), the newest first.
        Whether any was preempted."""
        if not self.waiting or not self.running:
            return False
        head = self.waiting[0]
        first_chunk = min(head.num_tokens, self.max_num_batched_tokens)
        blocks_needed = -(-first_chunk // self.block_manager.block_size)
        made_room = False
        while (
            self.block_manager.num_free_blocks < blocks_needed
            and self.running
            and self.running[-1].priority > head.priority
        ):
            self._preempt(self.running.pop())
            made_room = True
        return made_room

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_sort_key)


def _sort_key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key
