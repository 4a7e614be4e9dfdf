"""The pydantic models of the two custom resources: defaults, and the rules the CRD also enforces."""

from __future__ import annotations

import pytest
from modelfleet.converters.formats import ACCELERATORS
from modelfleet.operator.api import InferenceModelSpec, ModelVersionSpec
from modelfleet.operator.validation import InvalidResource, validate_inference_model, validate_model_version


def model(**spec_overrides) -> dict:
    spec = {"hardware": {"accelerator": "nvidia-l4"}, "traffic": [{"version": "v1", "weight": 100}]}
    spec.update(spec_overrides)
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "m"},
        "spec": spec,
    }


def version(**spec_overrides) -> dict:
    spec = {"model": "m", "version": "v1", "source": {"uri": "s3://bucket/m/v1"}}
    spec.update(spec_overrides)
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "ModelVersion",
        "metadata": {"name": "m-v1"},
        "spec": spec,
    }


def rejected(obj: dict) -> InvalidResource:
    validate = validate_inference_model if obj["kind"] == "InferenceModel" else validate_model_version
    with pytest.raises(InvalidResource) as caught:
        validate(obj)
    return caught.value


def test_inference_model_defaults():
    spec = validate_inference_model(model()).spec
    assert (spec.replicas.min, spec.replicas.max) == (1, 1)
    assert spec.hardware.count == 1 and spec.hardware.node_selector == {}
    assert spec.routing.sticky_by == "none"
    assert spec.loading.mode == "lazy" and spec.loading.idle_unload_after is None
    assert spec.engine.max_num_seqs == 256 and spec.engine.prefix_caching is True
    assert spec.rollout is None


def test_wire_names_are_camel_case_and_round_trip():
    obj = model(routing={"stickyBy": "header:X-Session"}, loading={"mode": "eager", "idleUnloadAfter": "30m"})
    spec = validate_inference_model(obj).spec
    assert spec.routing.sticky_by == "header:X-Session"
    dumped = spec.model_dump(by_alias=True)
    assert dumped["loading"] == {"mode": "eager", "idleUnloadAfter": "30m"}
    assert InferenceModelSpec.model_validate(dumped) == spec


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_every_hardware_class_is_accepted(accelerator):
    assert validate_inference_model(model(hardware={"accelerator": accelerator})).spec.hardware.accelerator


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (
            {"traffic": [{"version": "v1", "weight": 101}]},
            "spec.traffic[0].weight",
            "less than or equal to 100",
        ),
        (
            {"traffic": [{"version": "v1", "weight": 60}, {"version": "v2", "weight": 30}]},
            "spec.traffic",
            "90",
        ),
        ({"traffic": []}, "spec.traffic", "at least 1"),
        ({"traffic": [{"version": "V_1", "weight": 100}]}, "spec.traffic[0].version", "does not match"),
        ({"routing": {"stickyBy": "cookie"}}, "spec.routing.stickyBy", "does not match"),
        ({"replicas": {"min": 0, "max": 0}}, "spec.replicas.max", "greater than or equal to 1"),
        ({"hardware": {"accelerator": "cpu", "count": 0}}, "spec.hardware.count", "greater than or equal"),
        ({"loading": {"mode": "sometimes"}}, "spec.loading.mode", "'lazy' or 'eager'"),
        ({"loading": {"idleUnloadAfter": "ten minutes"}}, "spec.loading.idleUnloadAfter", "does not match"),
        ({"rollout": {"candidate": "v9"}}, "spec", "rollout.candidate 'v9' is not in traffic"),
        ({"rollout": {"candidate": "v1", "steps": [50, 10]}}, "spec.rollout.steps", "strictly increasing"),
        (
            {"rollout": {"candidate": "v1", "steps": [0, 100]}},
            "spec.rollout.steps[0]",
            "greater than or equal to 1",
        ),
        ({"engine": {"kvCacheMemoryFraction": 0}}, "spec.engine.kvCacheMemoryFraction", "greater than 0"),
    ],
)
def test_bad_inference_model_names_the_field(overrides, field, words):
    error = rejected(model(**overrides))
    assert error.field == field
    assert words in str(error)


@pytest.mark.parametrize(
    "uri", ["file:///models/m", "pvc://models/m/v1", "http://h/m", "https://h/m", "s3://b/m", "hf://org/m@v1"]
)
def test_supported_uri_schemes(uri):
    assert validate_model_version(version(source={"uri": uri})).spec.source.uri == uri


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"source": {"uri": "gs://bucket/m"}}, "spec.source.uri", "use one of file://, pvc://"),
        ({"source": {"uri": "/models/m"}}, "spec.source.uri", "no supported scheme"),
        ({"source": {"uri": "s3://b/m", "sha256": "abc"}}, "spec.source.sha256", "does not match"),
        ({"quantization": "int4"}, "spec.quantization", "'none', 'int8' or 'fp8'"),
        ({"quantizeLmHead": True}, "spec.quantizeLmHead", "applies to quantization int8 or fp8, not none"),
        (
            {"quantization": "none", "quantizeLmHead": True},
            "spec.quantizeLmHead",
            "set quantization: int8 or fp8, or quantizeLmHead: false",
        ),
        (
            {"targets": [{"accelerator": "cpu", "format": "gguf", "dtype": "int8"}]},
            "spec.targets[0].format",
            "gguf",
        ),
        ({"model": "Chat"}, "spec.model", "does not match"),
    ],
)
def test_bad_model_version_names_the_field(overrides, field, words):
    error = rejected(version(**overrides))
    assert error.field == field
    assert words in str(error)


def test_model_version_defaults_and_targets():
    spec: ModelVersionSpec = validate_model_version(
        version(targets=[{"accelerator": "cpu", "format": "onnx", "dtype": "int8"}])
    ).spec
    assert spec.quantization == "none" and spec.source.format == "hf-safetensors"
    assert spec.quantize_lm_head is False
    assert spec.targets[0].format == "onnx"


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_quantized_version_may_quantize_lm_head_too(quantization):
    spec = validate_model_version(version(quantization=quantization, quantizeLmHead=True)).spec
    assert spec.quantize_lm_head is True
    assert spec.model_dump(by_alias=True)["quantizeLmHead"] is True  # camelCase on the wire


def test_wrong_kind_or_api_version_is_one_clear_line():
    from modelfleet.operator.validation import validate_resource

    with pytest.raises(InvalidResource, match="kind: 'Deployment' is not one of ours"):
        validate_resource({"kind": "Deployment", "metadata": {"name": "x"}})
    obj = model()
    obj["apiVersion"] = "modelfleet.dev/v1"
    assert rejected(obj).field == "apiVersion"


def test_errors_count_the_other_problems():
    error = rejected(model(hardware={"accelerator": "tpu"}, replicas={"min": 3, "max": 2}))
    assert "(and 1 more)" in str(error)
