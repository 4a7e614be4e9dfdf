"""The served split: only versions with a Ready artifact for the hardware take traffic."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from modelfleet.operator.api import InferenceModelSpec
from modelfleet.operator.reconcile.traffic import VersionView, local_path, plan_traffic, redistribute
from modelfleet.operator.settings import OperatorSettings

SETTINGS = OperatorSettings()


def spec(accelerator: str = "nvidia-l4", **weights: int) -> InferenceModelSpec:
    traffic = [{"version": name, "weight": weight} for name, weight in weights.items()]
    return InferenceModelSpec.model_validate({"hardware": {"accelerator": accelerator}, "traffic": traffic})


def view(name: str, phase: str | None = "Ready", *artifacts: tuple[str, str, str], quantization="none"):
    return VersionView(
        name=name,
        resource_name=f"m-{name}",
        phase=phase,
        quantization=quantization,
        artifacts=[
            {
                "accelerator": a,
                "format": f,
                "dtype": d,
                "uri": f"file:///models/artifacts/m/{name}/{a}-{f}-{d}",
            }
            for a, f, d in artifacts
        ],
        message="converting nvidia-l4-torch-fp16" if phase == "Converting" else "",
    )


L4 = ("nvidia-l4", "torch", "fp16")


def served(planned) -> dict[str, tuple[int, str]]:
    return {p.name: (p.weight, p.reason) for p in planned}


def test_all_ready_serves_the_requested_split():
    planned = plan_traffic(
        spec(v1=90, v2=10), {"v1": view("v1", "Ready", L4), "v2": view("v2", "Ready", L4)}, SETTINGS
    )
    assert served(planned) == {"v1": (90, "Servable"), "v2": (10, "Servable")}


def test_a_converting_version_gets_zero_and_its_share_moves():
    views = {"v1": view("v1", "Ready", L4), "v2": view("v2", "Converting")}
    planned = plan_traffic(spec(v1=90, v2=10), views, SETTINGS)
    assert served(planned) == {"v1": (100, "Servable"), "v2": (0, "VersionNotReady")}
    assert planned[1].desired_weight == 10 and planned[1].artifact_path is None
    assert "Converting" in planned[1].message


def test_artifacts_for_other_hardware_do_not_count():
    views = {"v1": view("v1", "Ready", ("nvidia-a100", "torch", "bf16"))}
    (planned,) = plan_traffic(spec(v1=100), views, SETTINGS)
    assert (planned.weight, planned.reason) == (0, "NoArtifactForHardware")
    assert "spec.targets" in planned.message


def test_a_missing_version_is_named():
    planned = plan_traffic(spec(v1=50, v9=50), {"v1": view("v1", "Ready", L4)}, SETTINGS)
    assert served(planned) == {"v1": (100, "Servable"), "v9": (0, "VersionNotFound")}
    assert "'v9'" in planned[1].message


def test_nothing_servable_means_all_zero():
    planned = plan_traffic(spec(v1=100), {"v1": view("v1", "Failed")}, SETTINGS)
    assert served(planned) == {"v1": (0, "VersionNotReady")}


def test_a_zero_weight_version_stays_zero_but_pinnable():
    planned = plan_traffic(
        spec(v1=100, v2=0), {"v1": view("v1", "Ready", L4), "v2": view("v2", "Ready", L4)}, SETTINGS
    )
    assert served(planned) == {"v1": (100, "Servable"), "v2": (0, "Servable")}
    assert planned[1].artifact_path == "/models/artifacts/m/v2/nvidia-l4-torch-fp16"


def test_quantized_artifact_preferred_when_asked_for():
    artifacts = (L4, ("nvidia-l4", "torch", "int8"))
    plain = plan_traffic(spec(v1=100), {"v1": view("v1", "Ready", *artifacts)}, SETTINGS)
    quant = plan_traffic(spec(v1=100), {"v1": view("v1", "Ready", *artifacts, quantization="int8")}, SETTINGS)
    assert plain[0].artifact_path.endswith("nvidia-l4-torch-fp16")
    assert quant[0].artifact_path.endswith("nvidia-l4-torch-int8")


def test_artifact_paths_on_the_model_store():
    assert local_path("file:///models/a/b", SETTINGS) == "/models/a/b"
    assert local_path(f"pvc://{SETTINGS.model_store_claim}/artifacts/x", SETTINGS) == "/models/artifacts/x"
    assert local_path("s3://bucket/x", SETTINGS) is None


def test_redistribute_rounds_to_exactly_100():
    assert redistribute({"a": 30, "b": 30, "c": 30}) == {"a": 34, "b": 33, "c": 33}
    assert redistribute({"a": 0, "b": 0}) == {"a": 0, "b": 0}


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 100), min_size=1))
def test_redistribute_keeps_proportions_and_sums_to_100(weights):
    out = redistribute(weights)
    total = sum(weights.values())
    assert sum(out.values()) == (100 if total else 0)
    for name, weight in weights.items():
        assert abs(out[name] - (weight * 100 / total if total else 0)) < 1


def test_a_tensorrt_artifact_is_served_only_where_the_image_has_tensorrt():
    engine, onnx = ("nvidia-l4", "tensorrt", "fp16"), ("nvidia-l4", "onnx", "fp16")
    views = {"v1": view("v1", "Ready", engine, onnx)}
    without = plan_traffic(spec(v1=100), views, OperatorSettings(dataplane_tensorrt=False))
    assert without[0].artifact_path.endswith("nvidia-l4-onnx-fp16")
    with_trt = plan_traffic(spec(v1=100), views, OperatorSettings(dataplane_tensorrt=True))
    assert with_trt[0].artifact_path.endswith("nvidia-l4-tensorrt-fp16")
    only_engine = plan_traffic(spec(v1=100), {"v1": view("v1", "Ready", engine)}, SETTINGS)
    assert served(only_engine) == {"v1": (0, "NoArtifactForHardware")}
