"""The engine's configuration: user choices. Values the engine derives (KV blocks, EOS ids) are not here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")  # here, not in attention/kv_quant.py: this module imports no torch
# Decode steps a waiting request waits at most for others to join it, where decode steps replay CUDA
# graphs (EngineConfig.prefill_wait_steps). On an H100 with a 1B model at 256 streams of 128 tokens two
# requests arrive per step: unheld, nearly every step ran eagerly. With those steps in piecewise graphs
# (2.6 ms of launch on an H200 host against 0.8 for a decode replay) holding still paid: at 256 streams
# through the server, 8 steps gave 71-82k output tok/s against 45-68k held 2 and 48-63k unheld.
PREFILL_WAIT_STEPS = 8
# A step's token budget (prefill chunks plus decodes) by default (EngineConfig.max_num_batched_tokens).
# Where decode steps replay CUDA graphs, a step with prompts in it costs more to launch than a decode
# step (eagerly ~9-10 ms of host time on an H200 host for the 1B preset whether it carried 2 prompts or
# 8, in piecewise graphs ~2.6 ms; bench/mixed_step.py --drain). There the budget grows with the sequence
# slots (requests arrive in proportion to those running), so that one such step admits what the held
# steps gathered rather than a few steps in a row each admitting part of it.
TOKEN_BUDGET = 2048
GRAPHED_TOKENS_PER_SEQ = 16
GRAPHED_TOKEN_BUDGET_MAX = 8192


@dataclass
class EngineConfig:
    model: str
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # Token budget of one step (prefill chunks plus decodes). None: token_budget's default.
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    # KV-cache budget on the CPU, in bytes.
    kv_cache_bytes: int = 1 << 30
    # KV-cache budget on accelerators: this fraction of the memory free after loading the model.
    kv_cache_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    # Host memory for prefix-cache blocks evicted from the KV cache, in bytes (pinned on CUDA); requests
    # whose prefix hits them copy them back instead of recomputing them. 0: off.
    host_kv_cache_bytes: int = 0
    enable_chunked_prefill: bool = True
    # Steps of pure decodes a waiting request may be held back for, so that requests arriving one by one
    # are admitted together: a step with a prompt in it costs more to launch than a pure decode's graph.
    # None: PREFILL_WAIT_STEPS where decode graphs are captured, else 0 (never held).
    prefill_wait_steps: int | None = None
    # "auto": bfloat16 on accelerators, float32 on the CPU.
    dtype: str = "auto"
    # The KV cache's element type: "auto" (the model's dtype) or "fp8" (float8 e4m3 with a static scale
    # per layer for K and V: twice the tokens in the same bytes; CUDA GPUs of compute capability >= 8.9,
    # emulated on the CPU). See modelfleet.dataplane.attention.kv_quant.
    kv_cache_dtype: str = "auto"
    # None: the best device present (see modelfleet.dataplane.device).
    device: str | None = None
    seed: int = 0
    # True: no CUDA graphs; decode steps run the model eagerly (for debugging, or to save graph memory).
    enforce_eager: bool = False
    # Steps with prompt tokens replay piecewise CUDA graphs (all of the forward but attention, captured
    # per token count; kernels/piecewise_graphs.py) where decode steps replay graphs. False: they run
    # the model eagerly (less graph memory, a slower start).
    piecewise_graphs: bool = True
    # Ranks one model is split over (its attention heads, MLP and vocabulary): GPUs of one node (NCCL),
    # or processes on the CPU (gloo). It must divide the model's attention heads.
    tensor_parallel_size: int = 1
    # Speculative decoding (engine/speculative.py): "none", "ngram" (drafts looked up in the prompt and
    # output) or "draft" (a smaller checkpoint with the same tokenizer, speculative_draft_model). Steps
    # then read their tokens back before the next is planned; decode-only verify steps have CUDA graphs.
    speculative_proposer: str = "none"
    # Draft tokens verified per sequence and step, at most.
    num_speculative_tokens: int = 4
    speculative_draft_model: str | None = None

    def __post_init__(self) -> None:
        self.model = str(self.model)
        if not Path(self.model).is_dir():
            raise ValueError(
                f"model: {self.model!r} is not a directory; pass a Hugging Face checkpoint folder"
            )
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("block_size", self.block_size)
        _positive_int("kv_cache_bytes", self.kv_cache_bytes)
        if isinstance(self.host_kv_cache_bytes, bool) or not isinstance(self.host_kv_cache_bytes, int):
            raise ValueError(f"host_kv_cache_bytes: {self.host_kv_cache_bytes!r} must be an integer (0: off)")
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes: {self.host_kv_cache_bytes} must be 0 (off) or more")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
            if self.max_model_len < 2:
                raise ValueError(
                    "max_model_len: must be at least 2 (one prompt token and one generated token)"
                )
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction: {self.kv_cache_memory_fraction} is outside (0, 1]; "
                "use e.g. 0.9 for 90% of free device memory"
            )
        for name in ("enforce_eager", "piecewise_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: {getattr(self, name)!r} must be true or false")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            _check_tensor_parallel(self)
        _check_speculative(self)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens is not None
        ):
            check_prefill_fits(self.max_num_batched_tokens, self.max_model_len)
        if self.prefill_wait_steps is not None and (
            isinstance(self.prefill_wait_steps, bool)
            or not isinstance(self.prefill_wait_steps, int)
            or self.prefill_wait_steps < 0
        ):
            raise ValueError(
                f"prefill_wait_steps: {self.prefill_wait_steps!r} must be an integer >= 0 (0: never held)"
            )

    @classmethod
    def from_kwargs(cls, model: str | Path, **kwargs: Any) -> EngineConfig:
        """Builds a config from keyword arguments, refusing unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"{unknown[0]}: not an engine setting; known settings: {', '.join(sorted(known))}"
            )
        return cls(model=str(model), **kwargs)


def token_budget(
    configured: int | None, max_num_seqs: int, decode_graphs: bool, whole_prompt: int = 0
) -> int:
    """A step's token budget: the configured one, or TOKEN_BUDGET, raised where decode steps replay CUDA
    graphs to GRAPHED_TOKENS_PER_SEQ per sequence slot (at most GRAPHED_TOKEN_BUDGET_MAX), and to
    `whole_prompt` tokens (the longest prompt, where prompts are not split into chunks)."""
    if configured is not None:
        return configured
    budget = TOKEN_BUDGET
    if decode_graphs:
        budget = min(max(budget, GRAPHED_TOKENS_PER_SEQ * max_num_seqs), GRAPHED_TOKEN_BUDGET_MAX)
    return max(budget, whole_prompt)


def check_prefill_fits(max_num_batched_tokens: int, max_model_len: int) -> None:
    """Without chunked prefill a whole prompt must fit into one step's token budget."""
    if max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {max_num_batched_tokens} is below max_model_len {max_model_len}; "
            "raise it or enable chunked prefill"
        )


def _check_tensor_parallel(config: EngineConfig) -> None:
    """The model's heads and MLP split over the ranks, and a GPU per rank where GPUs are asked for.
    (A missing or broken config.json is reported when the model loads.)"""
    import json

    from modelfleet.dataplane.parallel.sharding import check_tensor_parallel

    try:
        raw = json.loads((Path(config.model) / "config.json").read_text())
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        intermediate = int(raw["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    else:
        check_tensor_parallel(
            config.tensor_parallel_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=intermediate,
        )
    if config.device is not None and str(config.device).startswith("cuda"):
        import torch

        # device_count opens no CUDA context (the server process needs none).
        count = torch.cuda.device_count()
        if config.tensor_parallel_size > count:
            raise ValueError(
                f"tensor_parallel_size: {config.tensor_parallel_size} exceeds the {count} GPUs of this node"
            )


def _check_speculative(config: EngineConfig) -> None:
    proposers = ("none", "ngram", "draft")
    if config.speculative_proposer not in proposers:
        raise ValueError(
            f"speculative_proposer: {config.speculative_proposer!r} is not one of {', '.join(proposers)}"
        )
    _positive_int("num_speculative_tokens", config.num_speculative_tokens)
    draft = config.speculative_draft_model
    if (draft is not None) != (config.speculative_proposer == "draft"):
        raise ValueError(
            "speculative_draft_model: set it exactly when speculative_proposer is 'draft' "
            f"(proposer {config.speculative_proposer!r}, draft model {draft!r})"
        )
    if draft is not None:
        config.speculative_draft_model = draft = str(draft)
        if not Path(draft).is_dir():
            raise ValueError(f"speculative_draft_model: {draft!r} is not a checkpoint directory")
    if config.speculative_proposer != "none" and config.tensor_parallel_size > 1:
        raise ValueError("speculative_proposer: speculative decoding runs with tensor_parallel_size 1 only")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {value!r} must be a positive integer")
