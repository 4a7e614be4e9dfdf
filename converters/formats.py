"""The hardware table: which accelerators the fleet knows, and which artifact formats and dtypes each serves.

The operator reads it to schedule pods (device resource name, node label) and to pick the conversion
targets of a ModelVersion; the converter reads it to refuse a dtype the hardware lacks. Everything here is
plain data and pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

# Artifact formats: `torch` = Hugging Face safetensors (the engine's own loader), `onnx` = ONNX with
# external data (onnxruntime), `tensorrt` = a serialized TensorRT engine built from the ONNX artifact.
# Each has its data-plane loader (dataplane/server/loading.py, ARTIFACT_FORMATS; tests/seams checks):
# a format is added here only with one.
FORMATS = ("torch", "onnx", "tensorrt")
DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8")
QUANTIZATIONS = ("none", "int8", "fp8")

# The dtypes each format can hold. int8 ONNX = onnxruntime dynamic quantization (CPU); fp8 only as torch.
FORMAT_DTYPES: dict[str, tuple[str, ...]] = {
    "torch": ("fp32", "fp16", "bf16", "int8", "fp8"),
    "onnx": ("fp32", "fp16", "int8"),
    "tensorrt": ("fp32", "fp16", "bf16"),
}


@dataclass(frozen=True)
class HardwareClass:
    name: str
    vendor: str
    resource_name: str | None  # the extended resource a device plugin advertises; None = no device to request
    node_label: tuple[str, str] | None  # (key, value) that selects nodes with this hardware; None = any node
    memory_gib: int | None  # per device; None = host memory (cpu)
    dtypes: tuple[str, ...]  # what it computes in; the first is the full-precision serving dtype
    formats: tuple[str, ...]  # artifact formats it serves, preferred first

    def supports(self, format: str, dtype: str) -> bool:
        return format in self.formats and dtype in self.dtypes and dtype in FORMAT_DTYPES[format]


@dataclass(frozen=True)
class Target:
    accelerator: str
    format: str
    dtype: str

    def as_dict(self) -> dict[str, str]:
        return {"accelerator": self.accelerator, "format": self.format, "dtype": self.dtype}

    @property
    def quantized_torch(self) -> bool:
        """An int8/fp8 per-channel torch artifact: its linears are quantized, and its lm_head can be too
        (`modelfleet convert --quantize-lm-head`, a ModelVersion's spec.quantizeLmHead)."""
        return self.format == "torch" and self.dtype in ("int8", "fp8")


# Node labels are the ones the vendors' feature-discovery daemons set: NVIDIA GPU feature discovery
# (nvidia.com/gpu.product), the AMD GPU labeller (amd.com/gpu.product-name) and Intel's GPU plugin with
# node feature discovery. fp8 is listed only where tensor cores compute in it (Hopper, Ada, CDNA3);
# bf16 is absent on Turing (T4).
HARDWARE: dict[str, HardwareClass] = {
    hw.name: hw
    for hw in (
        HardwareClass(
            name="nvidia-h100",
            vendor="nvidia",
            resource_name="nvidia.com/gpu",
            node_label=("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            memory_gib=80,
            dtypes=("bf16", "fp16", "fp32", "fp8", "int8"),
            formats=("torch", "tensorrt", "onnx"),
        ),
        HardwareClass(
            name="nvidia-h200",
            vendor="nvidia",
            resource_name="nvidia.com/gpu",
            node_label=("nvidia.com/gpu.product", "NVIDIA-H200"),
            memory_gib=141,
            dtypes=("bf16", "fp16", "fp32", "fp8", "int8"),
            formats=("torch", "tensorrt", "onnx"),
        ),
        HardwareClass(
            name="nvidia-a100",
            vendor="nvidia",
            resource_name="nvidia.com/gpu",
            node_label=("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            memory_gib=80,
            dtypes=("bf16", "fp16", "fp32", "int8"),
            formats=("torch", "tensorrt", "onnx"),
        ),
        HardwareClass(
            name="nvidia-l4",
            vendor="nvidia",
            resource_name="nvidia.com/gpu",
            node_label=("nvidia.com/gpu.product", "NVIDIA-L4"),
            memory_gib=24,
            dtypes=("fp16", "bf16", "fp32", "fp8", "int8"),
            formats=("torch", "tensorrt", "onnx"),
        ),
        HardwareClass(
            name="nvidia-t4",
            vendor="nvidia",
            resource_name="nvidia.com/gpu",
            node_label=("nvidia.com/gpu.product", "Tesla-T4"),
            memory_gib=16,
            dtypes=("fp16", "fp32", "int8"),
            formats=("torch", "tensorrt", "onnx"),
        ),
        HardwareClass(
            name="amd-mi300x",
            vendor="amd",
            resource_name="amd.com/gpu",
            node_label=("amd.com/gpu.product-name", "AMD_Instinct_MI300X_OAM"),
            memory_gib=192,
            dtypes=("bf16", "fp16", "fp32", "fp8", "int8"),
            formats=("torch", "onnx"),
        ),
        HardwareClass(
            name="intel-gpu",
            vendor="intel",
            resource_name="gpu.intel.com/i915",
            node_label=("intel.feature.node.kubernetes.io/gpu", "true"),
            memory_gib=48,
            dtypes=("bf16", "fp16", "fp32", "int8"),
            formats=("torch", "onnx"),
        ),
        HardwareClass(
            name="apple-m",
            vendor="apple",
            resource_name=None,
            node_label=("kubernetes.io/arch", "arm64"),
            memory_gib=None,
            dtypes=("fp16", "bf16", "fp32"),
            formats=("torch",),
        ),
        HardwareClass(
            name="cpu",
            vendor="any",
            resource_name=None,
            node_label=None,
            memory_gib=None,
            dtypes=("bf16", "fp32", "int8"),
            formats=("onnx", "torch"),
        ),
    )
}

ACCELERATORS = tuple(HARDWARE)

# The format a quantized target is written in, where it is not the hardware's first format: int8 on a
# GPU is the engine's weight-only torch checkpoint; int8 on cpu is onnxruntime's dynamic quantization.
_QUANTIZED_FORMAT = {"cpu": "onnx"}


def hardware(accelerator: str) -> HardwareClass:
    """The hardware class named `accelerator`, or ValueError naming the allowed ones."""
    try:
        return HARDWARE[accelerator]
    except KeyError:
        raise ValueError(
            f"accelerator {accelerator!r} is unknown; use one of: {', '.join(ACCELERATORS)}"
        ) from None


def default_targets(accelerator: str, quantization: str | None = "none") -> list[Target]:
    """The conversion targets of a ModelVersion that names no explicit `targets`.

    Always the hardware's full-precision serving dtype (the fallback and the reference the quantized one is
    validated against), plus the quantized artifact when `quantization` asks for one.
    """
    hw = hardware(accelerator)
    quantization = quantization or "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is unknown; use one of: {', '.join(QUANTIZATIONS)}")
    base_dtype = next(d for d in hw.dtypes if d in ("bf16", "fp16", "fp32"))
    base_format = "torch" if "torch" in hw.formats else hw.formats[0]
    targets = [Target(accelerator, base_format, base_dtype)]
    if quantization == "none":
        return targets
    if quantization not in hw.dtypes:
        allowed = ", ".join(["none"] + [q for q in QUANTIZATIONS[1:] if q in hw.dtypes])
        raise ValueError(
            f"quantization {quantization!r} is not supported on {accelerator}; use one of: {allowed}"
        )
    fmt = _QUANTIZED_FORMAT.get(accelerator, "torch")
    targets.append(Target(accelerator, fmt, quantization))
    return targets


def check_target(accelerator: str, format: str, dtype: str) -> Target:
    """An explicit target, checked against the table; ValueError names what is allowed instead."""
    hw = hardware(accelerator)
    if format not in FORMATS:
        raise ValueError(f"format {format!r} is unknown; use one of: {', '.join(FORMATS)}")
    if format not in hw.formats:
        raise ValueError(
            f"format {format!r} is not served on {accelerator}; use one of: {', '.join(hw.formats)}"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; use one of: {', '.join(DTYPES)}")
    allowed = [d for d in hw.dtypes if d in FORMAT_DTYPES[format]]
    if dtype not in allowed:
        names = ", ".join(allowed)
        raise ValueError(
            f"dtype {dtype!r} is not supported for {format} on {accelerator}; use one of: {names}"
        )
    return Target(accelerator, format, dtype)
