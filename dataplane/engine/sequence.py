"""The state of one request inside the engine: its tokens, how far its KV is computed, and its blocks."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Any

from modelfleet.dataplane.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Preempted: its blocks were freed; it waits to be recomputed from its tokens.
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Prompt then outputs; the scheduler and block manager read it, so it is kept rather than rebuilt.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        # FCFS tie-break within a priority; preempted requests keep theirs.
        self.arrival_index = next(_arrival_counter)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache, or being computed by a launched step.
        self.num_computed_tokens = 0
        # Tokens sampled by launched steps but not yet on the host (see LLMEngine.step: the next step
        # is launched before the previous one's tokens are read back), and the row of the latest one in
        # its step's sampled-token tensor, from which the next step reads its input id on the device.
        self.num_inflight = 0
        self.sample_row = -1
        # Tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        # Chained hashes of this sequence's full blocks, computed once each.
        self.block_hashes: list[int] = []
        # Read for every sequence on every step, so taken from the parameters once: whether sampling
        # needs only temperatures (the fused sampler; a grammar's mask is applied before either sampler)
        # and whether penalties read the tokens on the host.
        self.temperature_only = params.temperature_only or (
            params.structured is not None and dataclasses.replace(params, structured=None).temperature_only
        )
        self.has_penalties = params.has_penalties
        # Whether a speculative engine proposes drafts for it (engine/speculative.py): greedy, or sampling
        # with a temperature alone and no seed of its own (filters do not move a greedy token; penalties,
        # biases, logprobs and grammars need the sampler's own path).
        self.speculates = (
            params.logprobs is None
            and not params.has_penalties
            and not params.logit_bias
            and params.structured is None
            and (params.greedy or (params.temperature_only and params.seed is None))
        )
        # Tokens whose keys and values a draft model has in its cache (speculative.DraftProposer).
        self.num_draft_computed = 0
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        # The sampler's random generator for a request with a seed (opaque here: no torch in this module).
        self.generator: object | None = None
        # Structured output: the grammar matcher that masks this sequence's logits (engine/structured.py).
        self.grammar: Any = None  # a structured.SequenceGrammar (xgrammar is not imported here)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_inflight(self) -> int:
        return len(self.token_ids) + self.num_inflight

    def last_token_in_flight(self, max_model_len: int) -> bool:
        """Whether a token in flight already reaches max_tokens or max_model_len: no step need run for
        the sequence again (check_stop ends it once the token is known)."""
        inflight = self.num_inflight
        return inflight > 0 and (
            len(self.output_token_ids) + inflight >= self.params.max_tokens
            or len(self.token_ids) + inflight >= max_model_len
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_index)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> str | None:
        """The finish reason after the last appended token, from token ids and lengths alone."""
        # Lengths read directly: this runs for every sequence on every step.
        output_token_ids = self.output_token_ids
        if output_token_ids[-1] in self.stop_token_ids:
            return "stop"
        if len(output_token_ids) >= self.params.max_tokens or len(self.token_ids) >= max_model_len:
            return "length"
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
