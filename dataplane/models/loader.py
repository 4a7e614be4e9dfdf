"""Fill a meta-device model from safetensors files (memory-mapped), checking every tensor first.

A tensor-parallel rank reads only its slice of each sharded tensor (a module's `tp_shard`, see
parallel/sharding.py), with safetensors' get_slice: rows for column-parallel and vocabulary shards,
input columns for row-parallel weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from modelfleet.dataplane.parallel.sharding import Shard
from safetensors import safe_open
from torch import nn

# Checkpoint tensors that some exporters write but that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


class CheckpointError(ValueError):
    """The weights do not match the architecture in config.json (missing, unexpected, mis-shaped)."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files; convert the checkpoint to safetensors")
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in model.safetensors.index.json but missing")
    return files


class _Checkpoint:
    """Lazy name -> tensor access over several memory-mapped safetensors files."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        self._where: dict[str, Any] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._where[name] = handle

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def get_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._where[name].get_slice(name)[index]


def _sources(model: nn.Module, param_name: str) -> list[str]:
    """Checkpoint names whose tensors make up one of our parameters (several for fused projections)."""
    module_name, _, attr = param_name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if hasattr(module, "part_names"):  # a fused projection (see layers.linear.make_linear)
        parent = module_name.rpartition(".")[0]
        return [f"{parent}.{part}.{attr}" for part in module.part_names]
    return [param_name]


def _part_shapes(model: nn.Module, param_name: str, shape: torch.Size) -> list[tuple[int, ...]]:
    module_name = param_name.rpartition(".")[0]
    module = model.get_submodule(module_name) if module_name else model
    if hasattr(module, "part_sizes"):
        return [(size, *shape[1:]) for size in module.part_sizes]
    return [tuple(shape)]


def _sharded_source(
    shard: Shard | None, attr: str, part: int, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[slice, ...] | None]:
    """(the checkpoint tensor's full shape, the slice this rank reads or None for all of it) for part
    `part` of a module's tensor `attr` whose local shape is `shape`."""
    if shard is None:
        return shape, None
    if shard.dim == 0:  # every tensor of the module is cut by rows
        start, end = shard.ranges[part]
        return (shard.full_sizes[part], *shape[1:]), (slice(start, end),)
    if attr != "weight":  # row-parallel bias and per-output-channel scale: whole
        return shape, None
    start, end = shard.ranges[0]
    return (shape[0], shard.full_sizes[0]), (slice(None), slice(start, end))


def _read(ckpt: _Checkpoint, source: str, index: tuple[slice, ...] | None, rows: int | None) -> torch.Tensor:
    if index is None:
        return ckpt.get(source)
    tensor = ckpt.get_slice(source, index)
    if rows is not None and tensor.shape[0] < rows:  # a vocabulary shard's padding
        pad = torch.zeros((rows - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
        tensor = torch.cat([tensor, pad])
    return tensor


def _convert(name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Floating weights take the serving dtype; quantized payloads (int8/fp8) and their scales keep theirs.
    quantized = tensor.dtype in _QUANTIZED_DTYPES or name.endswith("_scale")
    if tensor.dtype.is_floating_point and not quantized:
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


def iter_state_dict(
    model: nn.Module, ckpt: _Checkpoint, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, tensor) for every parameter of `model`, raising CheckpointError on any mismatch."""
    expected = model.state_dict(keep_vars=True)
    for name, param in expected.items():
        module_name, _, attr = name.rpartition(".")
        shard = getattr(model.get_submodule(module_name) if module_name else model, "tp_shard", None)
        parts = []
        local_shapes = _part_shapes(model, name, param.shape)
        for i, (source, local) in enumerate(zip(_sources(model, name), local_shapes, strict=True)):
            shape, index = _sharded_source(shard, attr, i, local)
            if source not in ckpt:
                raise CheckpointError(f"checkpoint is missing tensor {source!r} (shape {list(shape)})")
            if ckpt.shape(source) != shape:
                raise CheckpointError(
                    f"checkpoint tensor {source!r} has shape {list(ckpt.shape(source))}; "
                    f"config.json implies {list(shape)}"
                )
            tensor = _read(ckpt, source, index, shard.rows if shard is not None else None)
            if param.dtype in _QUANTIZED_DTYPES and tensor.dtype != param.dtype:
                raise CheckpointError(
                    f"checkpoint tensor {source!r} has dtype {tensor.dtype}; config.json quantization_config "
                    f"needs {param.dtype} (was the checkpoint written by `modelfleet convert`?)"
                )
            parts.append(_convert(source, tensor, device, dtype))
        yield name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def load_weights(
    model: nn.Module,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    ignore: set[str] = frozenset(),
) -> None:
    """Load model_dir's safetensors into `model` (built on the meta device) with assign=True."""
    with ExitStack() as stack:
        ckpt = _Checkpoint(checkpoint_files(model_dir), stack)
        used: set[str] = set()
        for name in model.state_dict(keep_vars=True):
            used.update(_sources(model, name))
        unexpected = sorted(n for n in ckpt.names() - used - set(ignore) if not n.endswith(_IGNORED_SUFFIXES))
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise CheckpointError(
                f"checkpoint has unexpected tensor {unexpected[0]!r}{more}; is config.json for these weights?"
            )
        state = dict(iter_state_dict(model, ckpt, device, dtype))
    model.load_state_dict(state, strict=True, assign=True)
