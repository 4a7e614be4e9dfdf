"""TensorRT targets are planned only where the data-plane image carries TensorRT (a fleet setting)."""

from __future__ import annotations

import copy

import pytest
from modelfleet.converters.formats import Target
from modelfleet.operator.api import ModelVersion
from modelfleet.operator.reconcile.targets import TargetError, resolve_targets
from modelfleet.operator.settings import OperatorSettings, get_settings

TRT = Target("nvidia-h100", "tensorrt", "fp16")


@pytest.fixture()
def trt_version(example_objects):
    mv = copy.deepcopy(example_objects["chat-v1"])
    mv["spec"]["targets"] = [
        {"accelerator": "nvidia-h100", "format": "torch", "dtype": "bf16"},
        {"accelerator": "nvidia-h100", "format": "tensorrt", "dtype": "fp16"},
    ]
    return ModelVersion.model_validate(mv).spec


def test_tensorrt_targets_are_refused_unless_the_image_carries_tensorrt(trt_version):
    with pytest.raises(TargetError, match="needs a data-plane image with TensorRT") as caught:
        resolve_targets(trt_version, "nvidia-h100", tensorrt=False)
    assert caught.value.reason == "TensorRTUnavailable"
    assert resolve_targets(trt_version, "nvidia-h100", tensorrt=True)[-1] == TRT


def test_the_default_comes_from_the_fleet_setting_and_is_off(trt_version, monkeypatch):
    assert OperatorSettings().dataplane_tensorrt is False
    get_settings.cache_clear()
    try:
        with pytest.raises(TargetError):
            resolve_targets(trt_version, "nvidia-h100")
        monkeypatch.setenv("MODELFLEET_DATAPLANE_TENSORRT", "true")
        get_settings.cache_clear()
        assert TRT in resolve_targets(trt_version, "nvidia-h100")
    finally:
        monkeypatch.delenv("MODELFLEET_DATAPLANE_TENSORRT", raising=False)
        get_settings.cache_clear()


def test_default_targets_never_include_tensorrt(example_objects):
    for name in ("chat-v1", "chat-v2"):
        spec = ModelVersion.model_validate(example_objects[name]).spec
        for accelerator in ("nvidia-h100", "nvidia-a100", "nvidia-t4"):
            try:
                targets = resolve_targets(spec, accelerator, tensorrt=False)
            except TargetError:
                continue  # e.g. fp8 on a GPU without it
            assert all(t.format != "tensorrt" for t in targets)
