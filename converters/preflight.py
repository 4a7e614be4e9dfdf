"""Checks a source passes before any work is staged: what the engine would refuse to load, or what would
stop validation half-way with a library's traceback, is refused here in one line.

- the tensors: every one the engine's model of config.json needs, with the shape config.json implies and a
  floating dtype, and none it would not know (read from the safetensors headers, no tensor data);
- generation_config.json reads as the engine reads it;
- the tokenizer loads, and its ids fit config.json's vocab_size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from modelfleet.converters import validate
from modelfleet.converters.checkpoint import Checkpoint
from modelfleet.converters.errors import BadInputError
from modelfleet.dataplane.attention.torch_paged import TorchPagedAttention
from modelfleet.dataplane.models import CausalLM, ModelConfig
from modelfleet.dataplane.models.loader import CheckpointError, iter_state_dict
from safetensors import SafetensorError, safe_open

FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# Tensors some exporters write that the engine derives instead (as dataplane.models.loader ignores them).
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def check(ckpt: Checkpoint) -> tuple[list[list[int]], list[int]]:
    """Run every check; returns the validation token ids (prompts, text) that `check_tokenizer` made."""
    check_tensors(ckpt)
    check_generation_config(ckpt.path)
    return check_tokenizer(ckpt.path, ckpt.config["vocab_size"])


class _Headers:
    """The checkpoint as `iter_state_dict` reads it, from headers only: meta tensors of the right shape."""

    def __init__(self, tensors: dict[str, tuple[list[int], str]]) -> None:
        self.tensors, self.used = tensors, set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name][0])

    def get(self, name: str) -> torch.Tensor:
        self.used.add(name)
        shape, dtype = self.tensors[name]
        if dtype not in FLOAT_DTYPES:
            raise BadInputError(f"source tensor {name!r} has dtype {dtype}; weights are floating point")
        return torch.empty(shape, dtype=FLOAT_DTYPES[dtype], device="meta")


def check_tensors(ckpt: Checkpoint) -> None:
    tensors: dict[str, tuple[list[int], str]] = {}
    for shard in ckpt.shards:
        try:
            with safe_open(ckpt.path / shard, "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    part = f.get_slice(name)
                    tensors[name] = (part.get_shape(), part.get_dtype())
        except SafetensorError as exc:
            raise BadInputError(f"source {shard} is not a valid safetensors file ({exc})") from None
    config = ckpt.model_config
    with torch.device("meta"):
        model = CausalLM(config, TorchPagedAttention())
    headers = _Headers(tensors)
    try:
        for _ in iter_state_dict(model, headers, torch.device("meta"), torch.float32):  # type: ignore[arg-type]
            pass
    except CheckpointError as exc:
        raise BadInputError(f"source {exc}") from None
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in set(tensors) - headers.used - ignored if not n.endswith(DERIVED_SUFFIXES))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise BadInputError(
            f"source has tensor {unexpected[0]!r}{more} that config.json's {config.architecture} does not "
            "have; is config.json for these weights?"
        )


def check_generation_config(path: Path) -> None:
    if not (path / "generation_config.json").exists():
        return
    try:
        ModelConfig.from_dir(path)
    except (ValueError, TypeError) as exc:  # ConfigError, or a value of the wrong type
        raise BadInputError(f"source generation_config.json: {str(exc).splitlines()[0]}") from None


def check_tokenizer(path: Path, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    try:
        prompts, text = validate.token_ids(path, vocab_size)
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise BadInputError(f"source tokenizer.json cannot be loaded ({str(exc).splitlines()[0]})") from None
    top = max(max(ids, default=0) for ids in [*prompts, text])
    if top >= vocab_size:
        raise BadInputError(
            f"source tokenizer.json gives token id {top}, past config.json vocab_size {vocab_size}"
        )
    return prompts, text
