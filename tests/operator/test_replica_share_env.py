"""The operator tells each data-plane pod how many replicas share the API keys' limits."""

from __future__ import annotations

import copy

import pytest
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.settings import OperatorSettings


@pytest.mark.parametrize(("replicas", "share"), [({"min": 1, "max": 3}, "3"), ({"min": 2, "max": 2}, "2")])
def test_pods_divide_the_key_limits_by_the_most_replicas_there_may_be(example_objects, replicas, share):
    im = copy.deepcopy(example_objects["chat"])
    im["spec"]["replicas"] = replicas
    spec = InferenceModel.model_validate(im).spec
    settings = OperatorSettings(dataplane_image="registry.example/modelfleet:1")
    container = serving.deployment(im, spec, settings)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MODELFLEET_REPLICAS"] == share
