"""Run a staged artifact the way it will be served, as a logits function for validation."""

from __future__ import annotations

from pathlib import Path

import torch
from modelfleet.converters.checkpoint import TORCH_DTYPES
from modelfleet.converters.validate import LogitsFn, hf_logits_fn
from modelfleet.dataplane.quantization import QuantizedLinear, dequantize, fp8_supported
from safetensors import safe_open
from torch import nn


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_candidate(artifact: Path, dtype: str) -> tuple[LogitsFn, dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(artifact, dtype=TORCH_DTYPES[dtype]).to(device()).eval()
    return hf_logits_fn(model), {"method": "transformers", "device": device().type}


def quantized_candidate(artifact: Path, source: Path, fmt: str, serving_dtype: str) -> tuple[LogitsFn, dict]:
    """transformers' model of the source architecture with the artifact's tensors: each quantized Linear
    becomes our QuantizedLinear (the engine's kernel). fp8 without a capable GPU can only check the
    weights: they are dequantized into ordinary Linears, and the record says so."""
    from transformers import AutoModelForCausalLM

    dev = device()
    dtype = TORCH_DTYPES[serving_dtype]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    runs_quantized = fmt == "int8" or fp8_supported(dev)
    tensors = _artifact_tensors(artifact)
    for name, tensor in tensors.items():
        if name.endswith("_scale"):
            continue
        module_name, _, attr = name.rpartition(".")
        if name + "_scale" in tensors:
            linear = model.get_submodule(module_name)
            assert isinstance(linear, nn.Linear)
            if runs_quantized:
                q = QuantizedLinear(linear.in_features, linear.out_features, linear.bias is not None, fmt)
                q.weight, q.weight_scale = tensor, tensors[name + "_scale"]
                if linear.bias is not None:
                    q.bias = linear.bias
                parent, _, child = module_name.rpartition(".")
                setattr(model.get_submodule(parent), child, q)
            else:  # a new Parameter: a tied lm_head's quantized copy must not overwrite the embeddings
                linear.weight = nn.Parameter(dequantize(tensor, tensors[name + "_scale"], dtype), False)
        else:
            getattr(model.get_submodule(module_name), attr).data = tensor.to(dtype)
    model.to(dev)
    method = "quantized-kernels" if runs_quantized else "dequantized-weights"
    return hf_logits_fn(model), {"method": method, "device": dev.type}


def _artifact_tensors(artifact: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(artifact.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensors[name] = f.get_tensor(name)
    return tensors


def onnx_candidate(artifact: Path) -> tuple[LogitsFn, dict]:
    from modelfleet.dataplane.onnx_runner import OnnxRunner

    runner = OnnxRunner(artifact)

    def run(ids: list[int]) -> torch.Tensor:
        return torch.from_numpy(runner.logits(ids))

    return run, {"method": "onnxruntime-prefill-then-cache", "device": "cpu"}


def tensorrt_candidate(artifact: Path) -> tuple[LogitsFn, dict]:
    """The data plane's TensorRT runner, as it will serve the artifact."""
    from modelfleet.converters.tensorrt_engine import require_tensorrt
    from modelfleet.dataplane.tensorrt_engine import TensorRTRunner

    require_tensorrt()
    runner = TensorRTRunner(artifact)

    def run(ids: list[int]) -> torch.Tensor:
        return torch.from_numpy(runner.logits(ids))

    return run, {"method": "tensorrt-prefill-then-cache", "device": "cuda"}
