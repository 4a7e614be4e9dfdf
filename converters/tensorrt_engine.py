"""A TensorRT engine built from the ONNX artifact, where `tensorrt` and an NVIDIA GPU are present.

The engine keeps the ONNX graph's interface (converters/onnx_export.py) with one optimization profile
covering batch 1..MAX_BATCH and up to the model's context length. The data plane serves it with
`modelfleet.dataplane.tensorrt_engine` (file name and TensorRT check come from there), and validation
runs it through that same runner.
"""

from __future__ import annotations

from pathlib import Path

from modelfleet.converters import progress
from modelfleet.converters.errors import ConversionError, ToolMissingError
from modelfleet.converters.onnx_export import MODEL_FILE, io_names
from modelfleet.dataplane import tensorrt_engine as serving
from modelfleet.dataplane.models.config import ModelConfig

ENGINE_FILE = serving.ENGINE_FILE
MAX_BATCH = 8
OPT_BATCH = 4


def require_tensorrt():
    """The tensorrt module, or ToolMissingError naming what to install (the data plane's own check)."""
    try:
        return serving.require_tensorrt()
    except serving.TensorRTUnavailable as exc:
        raise ToolMissingError(str(exc)) from None


def build_engine(onnx_dir: Path, dest: Path, mc: ModelConfig, dtype: str) -> None:
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
    layers, kv, head_dim = mc.num_layers, mc.num_kv_heads, mc.head_dim
    max_len = min(mc.max_position_embeddings, 4096)
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
