"""Read a Hugging Face safetensors checkpoint (checking it first) and write it in a dtype or quantized."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from modelfleet.converters import progress
from modelfleet.converters.confine import index_shards, regular_file
from modelfleet.converters.errors import BadInputError
from modelfleet.dataplane.models.config import (
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    ModelConfig,
    UnsupportedModelError,
)
from modelfleet.dataplane.quantization import quantize
from safetensors import safe_open
from safetensors.torch import save_file

# The architectures are the engine's (one list: what we convert is what the data plane serves), and so are
# their facts (biases, norms, windows): `Checkpoint.model_config` reads them the way the engine does.
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Files copied unchanged into every artifact that has them (the engine needs the tokenizer beside weights).
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# Linear layers that are quantized; embeddings, norms and (unless asked, see QuantPlan) lm_head keep the
# serving dtype.
QUANTIZED_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
LM_HEAD = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict
    shards: dict[str, list[str]]  # shard file name -> tensor names in it

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]

    @property
    def model_config(self) -> ModelConfig:
        """The engine's reading of config.json (read_config has checked that it reads)."""
        return ModelConfig.from_hf_dict(self.config)

    def tensors(self, shard: str) -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(self.path / shard, "pt") as f:
            for name in self.shards[shard]:
                yield name, f.get_tensor(name)

    def num_tensors(self) -> int:
        return sum(len(names) for names in self.shards.values())


def read_checkpoint(path: Path) -> Checkpoint:
    """Check config.json and every safetensors file before any work: one clear line for each problem."""
    config = read_config(path)
    index = path / "model.safetensors.index.json"
    if os.path.lexists(index):  # shard names are plain file names, each read only inside `path`
        shard_names = index_shards(regular_file(path, index.name))
    elif os.path.lexists(path / "model.safetensors"):
        shard_names = ["model.safetensors"]
    else:
        raise BadInputError(f"source {path} has no model.safetensors (or index); only safetensors are read")
    shards = {name: check_safetensors(regular_file(path, name, "source shard")) for name in shard_names}
    return Checkpoint(path, config, shards)


def read_config(path: Path) -> dict:
    config_path = path / "config.json"
    if not os.path.lexists(config_path):
        raise BadInputError(f"source {path} has no config.json; is it a Hugging Face model folder?")
    try:
        config = json.loads(regular_file(path, config_path.name).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInputError(f"source config.json is not valid JSON ({exc}); re-export the model") from None
    if not isinstance(config, dict):
        raise BadInputError("source config.json is not a JSON object; re-export the model")
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BadInputError(
            f"source architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if config.get("quantization_config"):
        raise BadInputError(
            "source is already quantized (config.json quantization_config); give the bf16 model"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise BadInputError(f"source config.json lacks integer {key!r}; re-export the model")
    try:  # what the engine would refuse to load is refused before any work
        ModelConfig.from_hf_dict(config)
    except (UnsupportedModelError, ConfigError) as exc:
        raise BadInputError(f"source {str(exc).splitlines()[0]}") from None
    except (ValueError, TypeError) as exc:  # a value of the wrong type: float("x"), dict("x")
        raise BadInputError(f"source config.json has a value of the wrong type ({exc})") from None
    return config


def check_safetensors(path: Path) -> list[str]:
    """Tensor names of a safetensors file whose header and size agree; a truncated file is refused."""
    size = path.stat().st_size if path.exists() else -1
    if size < 0:
        raise BadInputError(f"source shard {path.name} is missing")
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, 100 << 20):  # the format caps headers at 100 MB
                raise ValueError(f"header length {header_len} is past the end of the file or over 100 MB")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadInputError(f"source {path.name} is not a valid safetensors file ({exc})") from None
    if 8 + header_len + end != size:
        raise BadInputError(
            f"source {path.name} is truncated or corrupt: header describes {8 + header_len + end} bytes, "
            f"file has {size}; download it again"
        )
    return [k for k in header if k != "__metadata__"]


def copy_side_files(source: Path, dest: Path) -> None:
    for name in SIDE_FILES:
        if os.path.lexists(source / name):  # a symlink out of `source` or a FIFO is refused, not copied
            shutil.copyfile(regular_file(source, name), dest / name)


@dataclass(frozen=True)
class QuantPlan:
    """Which source tensors an int8/fp8 per-channel artifact stores quantized (`fmt`), each as X.weight and
    X.weight_scale. `lm_head`: the output projection too (per vocabulary row); a tied checkpoint's is made
    from the embeddings, which stay float beside it. `float_dtype`: what the other floats become (None
    keeps them)."""

    fmt: str
    lm_head: bool = False
    tied: bool = False
    float_dtype: torch.dtype | None = None

    def tensors(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The artifact's tensors for one source tensor (none for a tied copy of lm_head it replaces)."""
        out: dict[str, torch.Tensor] = {}
        head = self.lm_head and name == LM_HEAD
        if head and self.tied:  # the copy some tied checkpoints carry: the embeddings are the head
            return out
        if tensor.dim() == 2 and (head or name.endswith(QUANTIZED_SUFFIXES)):
            out[name], out[name + "_scale"] = quantize(tensor, self.fmt)
            return out
        float_ok = self.float_dtype is not None and tensor.is_floating_point()
        out[name] = tensor.to(self.float_dtype) if float_ok else tensor
        if self.lm_head and self.tied and name == EMBEDDINGS:
            out[LM_HEAD], out[LM_HEAD + "_scale"] = quantize(tensor, self.fmt)
        return out

    def config(self) -> dict:
        """config.json's quantization_config (the engine reads it); lm_head only when it is quantized."""
        config = {"quant_method": "modelfleet", "format": self.fmt, "group": "per-channel"}
        return {**config, "lm_head": True} if self.lm_head else config


def write_torch(
    ckpt: Checkpoint,
    dest: Path,
    *,
    dtype: str,
    quant: str | None,
    serving_dtype: str,
    quantize_lm_head: bool = False,
) -> None:
    """Write safetensors shards (same layout as the source) in `dtype`, or quantized (`quant` int8/fp8)
    with every other tensor in `serving_dtype` (and lm_head quantized with `quantize_lm_head`). One shard
    in memory at a time."""
    if quantize_lm_head and not quant:
        raise BadInputError("quantizing lm_head needs an int8 or fp8 target")
    float_dtype = TORCH_DTYPES[serving_dtype if quant else dtype]
    tied = bool(ckpt.config.get("tie_word_embeddings", False))
    plan = QuantPlan(quant, quantize_lm_head, tied, float_dtype) if quant else None
    weight_map: dict[str, str] = {}
    with progress.task(f"convert to {quant or dtype}", ckpt.num_tensors()) as bar:
        for shard in ckpt.shards:
            out: dict[str, torch.Tensor] = {}
            for name, tensor in ckpt.tensors(shard):
                if plan is not None:
                    out.update(plan.tensors(name, tensor))
                else:
                    out[name] = tensor.to(float_dtype) if tensor.is_floating_point() else tensor
                bar.advance()
            weight_map.update(dict.fromkeys(out, shard))
            save_file(out, str(dest / shard), metadata={"format": "pt"})
            del out
    if quantize_lm_head and LM_HEAD + "_scale" not in weight_map:
        raise BadInputError(f"cannot quantize lm_head: the source has neither {LM_HEAD} nor {EMBEDDINGS}")
    if len(ckpt.shards) > 1:
        total = sum((dest / s).stat().st_size for s in ckpt.shards)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = dict(ckpt.config)
    config["torch_dtype"] = DTYPE_NAMES[float_dtype]
    config.pop("dtype", None)
    if plan is not None:
        config["quantization_config"] = plan.config()
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(ckpt.path, dest)
