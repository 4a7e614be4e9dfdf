"""hardware.count devices per replica become the engine's tensor_parallel_size in the serving manifest."""

from __future__ import annotations

import copy

import pytest
from modelfleet.dataplane.config import EngineConfig
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile.serving import engine_settings


def settings_for(im: dict, accelerator: str, count: int) -> dict:
    im = copy.deepcopy(im)
    im["spec"]["hardware"] = {"accelerator": accelerator, "count": count}
    return engine_settings(InferenceModel.model_validate(im).spec)


@pytest.mark.parametrize("count", [2, 4, 8])
def test_several_gpus_split_the_model(example_objects, count):
    settings = settings_for(example_objects["chat"], "nvidia-h100", count)
    assert settings["tensor_parallel_size"] == count
    assert set(settings) <= {f.name for f in EngineConfig.__dataclass_fields__.values()}


def test_one_device_adds_no_setting(example_objects):
    """A manifest of one device stays as it was (no reload of every served model on upgrade)."""
    assert "tensor_parallel_size" not in settings_for(example_objects["chat"], "nvidia-h100", 1)
    assert "tensor_parallel_size" not in settings_for(example_objects["chat"], "cpu", 1)


def test_on_cpu_the_count_is_engine_processes(example_objects):
    assert settings_for(example_objects["chat"], "cpu", 2)["tensor_parallel_size"] == 2
