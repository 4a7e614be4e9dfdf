"""What the engine hands back: per-request outputs and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # Cumulative generated text and tokens.
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

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One output saying what this one and the later one of the same request say: the later one's
        cumulative fields, both deltas."""
        return replace(
            later,
            new_text=self.new_text + later.new_text,
            new_token_ids=self.new_token_ids + later.new_token_ids,
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
