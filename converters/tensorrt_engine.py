"""A TensorRT engine built from the ONNX artifact, where `tensorrt` and an NVIDIA GPU are present.

The engine keeps the ONNX graph's interface (converters/onnx_export.py) with one optimization profile
covering batch 1..MAX_BATCH and up to the model's context length.
"""

from __future__ import annotations

from pathlib import Path

import torch
from modelfleet.converters import progress
from modelfleet.converters.errors import ConversionError, ToolMissingError
from modelfleet.converters.onnx_export import MODEL_FILE, io_names

ENGINE_FILE = "model.plan"
MAX_BATCH = 8
OPT_BATCH = 4


def require_tensorrt():
    """The tensorrt module, or ToolMissingError naming what to install."""
    try:
        import tensorrt
    except ImportError:
        raise ToolMissingError(
            "TensorRT is not installed: install the `tensorrt` package on a node with an NVIDIA GPU, "
            "or choose --format torch or onnx"
        ) from None
    if not torch.cuda.is_available():
        raise ToolMissingError("TensorRT needs an NVIDIA GPU and none is visible here; run on a GPU node")
    return tensorrt


def build_engine(onnx_dir: Path, dest: Path, config: dict, dtype: str) -> None:
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_dir / MODEL_FILE)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConversionError(f"TensorRT could not parse the ONNX model: {errors}")
    build_config = builder.create_builder_config()
    if dtype == "fp16":
        build_config.set_flag(trt.BuilderFlag.FP16)
    elif dtype == "bf16":
        build_config.set_flag(trt.BuilderFlag.BF16)
    layers = config["num_hidden_layers"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    max_len = min(config.get("max_position_embeddings", 4096), 4096)
    profile = builder.create_optimization_profile()
    inputs, _ = io_names(layers)
    for name in inputs:
        if name.startswith("past_key_values"):
            profile.set_shape(
                name,
                (1, kv, 0, head_dim),
                (OPT_BATCH, kv, max_len // 4, head_dim),
                (MAX_BATCH, kv, max_len - 1, head_dim),
            )
        elif name == "attention_mask":
            profile.set_shape(name, (1, 1), (OPT_BATCH, max_len // 4), (MAX_BATCH, max_len))
        else:
            profile.set_shape(name, (1, 1), (OPT_BATCH, 1), (MAX_BATCH, max_len))
    build_config.add_optimization_profile(profile)
    with progress.task("build tensorrt engine"):
        serialized = builder.build_serialized_network(network, build_config)
    if serialized is None:
        raise ConversionError("TensorRT failed to build the engine; see the log above")
    (dest / ENGINE_FILE).write_bytes(bytes(serialized))


class TensorRTLogits:
    """Runs the engine on one sequence (no cache) for validation: ids [T] -> float32 logits [T, vocab]."""

    def __init__(self, artifact: Path, config: dict) -> None:
        trt = require_tensorrt()
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine((artifact / ENGINE_FILE).read_bytes())
        self.context = self.engine.create_execution_context()
        self.layers = config["num_hidden_layers"]
        self.kv = config.get("num_key_value_heads", config["num_attention_heads"])
        self.head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        self.trt = trt

    def __call__(self, ids: list[int]) -> torch.Tensor:
        inputs, outputs = io_names(self.layers)
        t = len(ids)
        feeds = {
            "input_ids": torch.tensor([ids], dtype=torch.int64, device="cuda"),
            "attention_mask": torch.ones(1, t, dtype=torch.int64, device="cuda"),
            "position_ids": torch.arange(t, device="cuda")[None],
        }
        for name in inputs[3:]:
            dtype = _torch_dtype(self.trt, self.engine.get_tensor_dtype(name))
            feeds[name] = torch.zeros(1, self.kv, 0, self.head_dim, dtype=dtype, device="cuda")
        for name, tensor in feeds.items():
            tensor = tensor.to(_torch_dtype(self.trt, self.engine.get_tensor_dtype(name)))
            feeds[name] = tensor
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        results = {}
        for name in outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = _torch_dtype(self.trt, self.engine.get_tensor_dtype(name))
            results[name] = torch.empty(shape, dtype=dtype, device="cuda")
            self.context.set_tensor_address(name, results[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise ConversionError("TensorRT engine failed to run")
        stream.synchronize()
        return results["logits"][0].float().cpu()


def _torch_dtype(trt, dtype) -> torch.dtype:
    return {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
    }[dtype]
