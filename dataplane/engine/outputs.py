"""What the engine hands back: per-request outputs and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelfleet.dataplane.engine.stream_relay import RelayDone


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # Cumulative generated text and tokens. In a delta output (SamplingParams.output_kind "delta"): text,
    # token_ids and logprobs hold only what is new, and prompt_token_ids is empty.
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # What is new since the previous output of this request.
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    # Per generated token: {token_id: logprob} (top-N plus the chosen token), or None when not asked for.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    delta: bool = False
    # The last output of a stream whose rest a stream relay wrote to the client: what it wrote.
    relayed: RelayDone | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One output saying what this one and the later one of the same request say: the later one's
        cumulative fields (or both deltas, for delta outputs), both deltas."""
        new_text, new_token_ids = self.new_text + later.new_text, self.new_token_ids + later.new_token_ids
        if not later.delta:
            return replace(later, new_text=new_text, new_token_ids=new_token_ids)
        logprobs = None if later.logprobs is None else (self.logprobs or []) + later.logprobs
        return replace(
            later,
            text=new_text,
            token_ids=new_token_ids,
            new_text=new_text,
            new_token_ids=new_token_ids,
            logprobs=logprobs,
        )


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int = 0
    # Since the engine started, in tokens: prompt tokens looked up in the prefix cache, and found there.
    # Counters (not the ratio above) are what sums across pods.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The host KV tier: prompt tokens whose blocks were copied back from host memory (counted in the
    # prefix-cache hits too once copied), and blocks copied to host memory.
    host_kv_hits: int = 0
    host_kv_spills: int = 0
    # Speculative decoding, since the engine started (0 without it): verifications of drafts, draft
    # tokens, draft tokens accepted; accepted / drafted; tokens a sequence gains per verification.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
