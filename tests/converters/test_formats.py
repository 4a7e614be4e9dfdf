"""The hardware table and the default conversion targets."""

import pytest
from modelfleet.converters.formats import (
    ACCELERATORS,
    FORMAT_DTYPES,
    HARDWARE,
    Target,
    check_target,
    default_targets,
    hardware,
)

REQUIRED = {
    "nvidia-h100",
    "nvidia-h200",
    "nvidia-a100",
    "nvidia-l4",
    "nvidia-t4",
    "amd-mi300x",
    "intel-gpu",
    "apple-m",
    "cpu",
}


def test_table_has_every_required_class_and_consistent_rows():
    assert set(ACCELERATORS) >= REQUIRED
    for name, hw in HARDWARE.items():
        assert hw.name == name
        assert hw.formats and hw.dtypes
        assert set(hw.formats) <= set(FORMAT_DTYPES)
        assert hw.memory_gib is None or hw.memory_gib > 0
        assert hw.node_label is None or (len(hw.node_label) == 2 and all(hw.node_label))


def test_device_resource_names_and_labels():
    assert {HARDWARE[n].resource_name for n in ACCELERATORS if n.startswith("nvidia-")} == {"nvidia.com/gpu"}
    assert HARDWARE["amd-mi300x"].resource_name == "amd.com/gpu"
    assert HARDWARE["intel-gpu"].resource_name == "gpu.intel.com/i915"
    assert HARDWARE["cpu"].resource_name is None
    assert HARDWARE["nvidia-h100"].node_label[0] == "nvidia.com/gpu.product"
    assert HARDWARE["amd-mi300x"].node_label[0] == "amd.com/gpu.product-name"
    # Each GPU class is told apart by its label value.
    labels = [HARDWARE[n].node_label for n in ACCELERATORS if HARDWARE[n].resource_name]
    assert len(set(labels)) == len(labels)


def test_fp8_only_on_hardware_that_computes_in_it():
    with_fp8 = {n for n, hw in HARDWARE.items() if "fp8" in hw.dtypes}
    assert with_fp8 == {"nvidia-h100", "nvidia-h200", "nvidia-l4", "amd-mi300x"}
    assert "bf16" not in HARDWARE["nvidia-t4"].dtypes


@pytest.mark.parametrize(
    ("accelerator", "quantization", "expected"),
    [
        ("nvidia-h100", "none", [("torch", "bf16")]),
        ("nvidia-h100", "fp8", [("torch", "bf16"), ("torch", "fp8")]),
        ("nvidia-h200", "int8", [("torch", "bf16"), ("torch", "int8")]),
        ("nvidia-a100", "int8", [("torch", "bf16"), ("torch", "int8")]),
        ("nvidia-l4", "int8", [("torch", "fp16"), ("torch", "int8")]),
        ("nvidia-t4", None, [("torch", "fp16")]),
        ("amd-mi300x", "fp8", [("torch", "bf16"), ("torch", "fp8")]),
        ("cpu", "none", [("torch", "bf16")]),
        ("cpu", "int8", [("torch", "bf16"), ("onnx", "int8")]),
        ("apple-m", "none", [("torch", "fp16")]),
    ],
)
def test_default_targets(accelerator, quantization, expected):
    targets = default_targets(accelerator, quantization)
    assert [(t.format, t.dtype) for t in targets] == expected
    assert all(t.accelerator == accelerator for t in targets)
    # Every default target is itself a valid explicit target.
    for t in targets:
        assert check_target(t.accelerator, t.format, t.dtype) == t


def test_unknown_accelerator_names_the_allowed_ones():
    with pytest.raises(
        ValueError, match="accelerator 'nvidia-h999' is unknown; use one of: nvidia-h100"
    ) as e:
        default_targets("nvidia-h999", "none")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("accelerator", "quantization", "allowed"),
    [("cpu", "fp8", "none, int8"), ("nvidia-a100", "fp8", "none, int8"), ("apple-m", "int8", "none")],
)
def test_quantization_the_hardware_lacks_is_refused(accelerator, quantization, allowed):
    with pytest.raises(ValueError) as e:
        default_targets(accelerator, quantization)
    assert str(e.value) == (
        f"quantization {quantization!r} is not supported on {accelerator}; use one of: {allowed}"
    )


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization 'int4' is unknown; use one of: none, int8, fp8"):
        default_targets("nvidia-h100", "int4")


def test_check_target_refusals():
    with pytest.raises(ValueError, match="format 'tensorrt' is not served on cpu; use one of: onnx, torch"):
        check_target("cpu", "tensorrt", "fp32")
    with pytest.raises(ValueError, match="dtype 'fp8' is not supported for onnx on nvidia-h100"):
        check_target("nvidia-h100", "onnx", "fp8")
    with pytest.raises(ValueError, match="dtype 'bf16' is not supported for torch on nvidia-t4"):
        check_target("nvidia-t4", "torch", "bf16")
    with pytest.raises(ValueError, match="dtype 'int3' is unknown"):
        check_target("cpu", "torch", "int3")
    with pytest.raises(ValueError, match="format 'gguf' is unknown"):
        check_target("cpu", "gguf", "int8")


def test_target_and_lookup():
    assert Target("cpu", "onnx", "int8").as_dict() == {
        "accelerator": "cpu",
        "format": "onnx",
        "dtype": "int8",
    }
    assert hardware("nvidia-h200").memory_gib == 141
