"""How to pick the next tokens and when to stop, per request (names and meanings follow the OpenAI API)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy.
GREEDY_EPSILON = 1e-5
OUTPUT_KINDS = ("cumulative", "delta")
STRUCTURED_KINDS = ("json_object", "json_schema")
# Integers reach torch as int64: a value past this range would fail the whole batch's step, not just its
# own request, so it is refused when the request is added.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# OpenAI's own cap on top_logprobs (and vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Every stop string is looked for after every step: a request with thousands of them slowed every other
# request of its engine. OpenAI takes at most 4.
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 1000
# OpenAI's range for a logit bias: -100 bans a token, 100 all but forces it.
LOGIT_BIAS_LIMIT = 100.0
# OpenAI takes at most 300 biased tokens; each is a scatter on the device per step.
MAX_LOGIT_BIAS_TOKENS = 300


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1: all tokens.
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    # Number of most likely tokens whose log-probabilities are returned per generated token.
    logprobs: int | None = None
    ignore_eos: bool = False
    # Token id -> a value added to that token's logit before sampling (OpenAI's logit_bias). The engine
    # checks the ids against its vocabulary when the request is added.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: ("json_object", "") or ("json_schema", the schema as JSON text). The engine
    # compiles it into a grammar that masks the logits of every step (see engine/structured.py).
    structured: tuple[str, str] | None = None
    # "cumulative": each output carries the whole text, token ids and logprobs so far. "delta": only what
    # is new (streaming servers: a step's outputs then cost the same at token 10 and at token 10,000).
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field. Called again when a request is added, since the fields
        of a dataclass can be changed after it was built."""
        if not _is_int(self.n) or self.n != 1:
            raise ValueError(f"n: {self.n!r} is not supported; only n=1 (send several requests instead)")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: {self.temperature!r} must be >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: {self.top_p!r} must be in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(
                f"top_k: {self.top_k!r} must be -1 or 0 (all tokens) or a positive integer below 2**63"
            )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: {self.min_p!r} must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed: {self.seed!r} must be None or a 64-bit signed integer")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: {self.repetition_penalty!r} must be > 0 (1 means none)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: {value!r} must be in [-2, 2]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: {self.stop!r} must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise ValueError(
                f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters each"
            )
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: {self.stop_token_ids!r} must be non-negative integers")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: {self.max_tokens!r} must be an integer >= 1")
        bad_logprobs = not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        if self.logprobs is not None and bad_logprobs:
            raise ValueError(f"logprobs: {self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        self._validate_logit_bias()
        if self.structured is not None and (
            not isinstance(self.structured, tuple)
            or len(self.structured) != 2
            or self.structured[0] not in STRUCTURED_KINDS
            or not isinstance(self.structured[1], str)
        ):
            raise ValueError(
                f"structured: {self.structured!r} must be (kind, schema) with kind in {STRUCTURED_KINDS}"
            )
        if self.structured is not None and self.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with structured output (it ends with its JSON)")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind: {self.output_kind!r} must be one of {', '.join(OUTPUT_KINDS)}")

    def _validate_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias: {self.logit_bias!r} must be a mapping of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or not 0 <= token <= INT64_MAX:
                raise ValueError(f"logit_bias: key {token!r} must be a token id (an integer >= 0)")
            if not _is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias: the bias of token {token} must be in [-100, 100], not {bias!r}"
                )

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError if a biased token is outside the model's vocabulary (an index error mid-step
        would fail the whole batch)."""
        outside = [t for t in self.logit_bias if t >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def temperature_only(self) -> bool:
        """Whether sampling needs nothing but the temperature (no filters, penalties or logprobs)."""
        return (
            self.top_k <= 0
            and self.top_p == 1.0
            and self.min_p == 0.0
            and self.logprobs is None
            and not self.has_penalties
            and not self.logit_bias
            and self.structured is None
        )

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
