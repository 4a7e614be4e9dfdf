"""schema_checks admits a custom resource as the API server would: prune, default, validate (OpenAPI,
list types, CEL), with kubectl's messages; and it agrees with the pydantic models on what is valid."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelfleet.operator import schema_checks
from modelfleet.operator.validation import InvalidResource, validate_inference_model, validate_model_version

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def model(**spec) -> dict:
    base = {"hardware": {"accelerator": "cpu"}, "traffic": [{"version": "v1", "weight": 100}]}
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "chat"},
        "spec": {**base, **spec},
    }


def test_the_model_example_is_admitted_with_its_defaults_filled_in(crd_files):
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "model.yaml").read_text()) if d]
    stored = [schema_checks.check_object(crd_files[d["kind"]], d) for d in docs]
    assert stored[0]["spec"]["engine"]["kvCacheMemoryFraction"] == 0.9  # defaulted inside a given object
    assert stored[0]["spec"]["hardware"]["count"] == 1
    assert stored[1]["spec"]["quantization"] == "none"  # defaulted field
    assert stored[2]["spec"]["quantization"] == "fp8"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "replicas-min-above-max.yaml",
            'The InferenceModel "chat" is invalid: spec.replicas: Invalid value: "object": '
            "min must be <= max",
        ),
        (
            "weights-sum-90.yaml",
            'The InferenceModel "chat" is invalid: spec.traffic: Invalid value: "array": '
            "weights must sum to 100",
        ),
        ("missing-source.yaml", 'The ModelVersion "chat-v1" is invalid: spec.source: Required value'),
    ],
)
def test_bad_examples_get_kubectls_message(crd_files, name, message):
    doc = yaml.safe_load((EXAMPLES / "bad" / name).read_text())
    with pytest.raises(schema_checks.Invalid) as caught:
        schema_checks.check_object(crd_files[doc["kind"]], doc)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("replicas", "error"),
    [
        ({}, None),
        ({"max": 3}, None),
        ({"min": 0}, None),
        ({"min": 2, "max": 2}, None),
        # The has() guards loosen nothing: defaulting fills in the missing bound before the rule runs.
        ({"min": 2}, 'spec.replicas: Invalid value: "object": min must be <= max'),
        ({"min": 5, "max": 3}, 'spec.replicas: Invalid value: "object": min must be <= max'),
        (
            {"max": 0},
            "spec.replicas.max: Invalid value: 0: "
            "spec.replicas.max in body should be greater than or equal to 1",
        ),
        (
            {"min": 1001, "max": 1000},
            "spec.replicas.min: Invalid value: 1001: spec.replicas.min in body should be",
        ),
    ],
)
def test_replicas_rule_agrees_with_the_pydantic_model(crd_files, replicas, error):
    obj = model(replicas=replicas)
    errors = [str(e) for e in schema_checks.admit(crd_files["InferenceModel"], obj).errors]
    if error is None:
        assert errors == []
        validate_inference_model(obj)
    else:
        assert any(e.startswith(error) for e in errors), errors
        with pytest.raises(InvalidResource, match=r"spec\.replicas"):
            validate_inference_model(obj)


def model_version(**spec) -> dict:
    base = {"model": "chat", "version": "v1", "source": {"uri": "pvc://models/chat/v1"}}
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "ModelVersion",
        "metadata": {"name": "chat-v1"},
        "spec": {**base, **spec},
    }


LM_HEAD_REFUSED = (
    'spec: Invalid value: "object": quantizeLmHead applies to quantization int8 or fp8, not none'
)


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({}, None),
        ({"quantizeLmHead": False}, None),
        ({"quantization": "int8", "quantizeLmHead": True}, None),
        ({"quantization": "fp8", "quantizeLmHead": True}, None),
        # quantization is defaulted to none before the rule runs: leaving it out is asking for none.
        ({"quantizeLmHead": True}, LM_HEAD_REFUSED),
        ({"quantization": "none", "quantizeLmHead": True}, LM_HEAD_REFUSED),
    ],
)
def test_quantize_lm_head_rule_agrees_with_the_pydantic_model(crd_files, spec, error):
    obj = model_version(**spec)
    errors = [str(e) for e in schema_checks.admit(crd_files["ModelVersion"], obj).errors]
    if error is None:
        assert errors == []
        validate_model_version(obj)
    else:
        assert errors == [error]
        with pytest.raises(InvalidResource, match=r"spec\.quantizeLmHead: quantizeLmHead applies"):
            validate_model_version(obj)


def test_quantize_lm_head_is_defaulted_and_refused_with_kubectls_message(crd_files):
    crd = crd_files["ModelVersion"]
    assert schema_checks.check_object(crd, model_version())["spec"]["quantizeLmHead"] is False
    with pytest.raises(schema_checks.Invalid) as caught:
        schema_checks.check_object(crd, model_version(quantizeLmHead=True))
    assert str(caught.value) == f'The ModelVersion "chat-v1" is invalid: {LM_HEAD_REFUSED}'
    (error,) = schema_checks.admit(crd, model_version(quantization="int8", quantizeLmHead="yes")).errors
    assert str(error).startswith('spec.quantizeLmHead: Invalid value: "string"')


def test_unknown_fields_are_pruned_with_a_warning(crd_files):
    obj = model(gpus=2)
    obj["spec"]["hardware"]["vendor"] = "x"
    result = schema_checks.admit(crd_files["InferenceModel"], obj)
    assert result.errors == []
    assert sorted(result.warnings) == ['unknown field "spec.gpus"', 'unknown field "spec.hardware.vendor"']
    assert "gpus" not in result.object["spec"] and "vendor" not in result.object["spec"]["hardware"]


def test_a_value_of_the_wrong_type_stops_before_the_cel_rules(crd_files):
    errors = schema_checks.admit(crd_files["InferenceModel"], model(replicas={"min": "one"})).errors
    assert [str(e) for e in errors] == [
        'spec.replicas.min: Invalid value: "string": '
        'spec.replicas.min in body must be of type integer: "string"'
    ]


def test_metadata_name_and_api_version_are_checked(crd_files):
    crd = crd_files["InferenceModel"]
    bad_name = model()
    bad_name["metadata"]["name"] = "Chat"
    (error,) = schema_checks.admit(crd, bad_name).errors
    assert str(error).startswith('metadata.name: Invalid value: "Chat": a lowercase RFC 1123 subdomain')
    wrong_version = {**model(), "apiVersion": "modelfleet.dev/v1"}
    (error,) = schema_checks.admit(crd, wrong_version).errors
    assert str(error).startswith('apiVersion: Unsupported value: "modelfleet.dev/v1"')


def test_an_update_runs_the_transition_rules(crd_files):
    crd = crd_files["ModelVersion"]
    old = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "ModelVersion",
        "metadata": {"name": "chat-v1"},
        "spec": {"model": "chat", "version": "v1", "source": {"uri": "pvc://models/chat/v1"}},
    }
    assert schema_checks.admit(crd, copy.deepcopy(old), old=old).errors == []
    # Defaults count: writing the defaulted value explicitly is no change.
    explicit = copy.deepcopy(old)
    explicit["spec"]["quantization"] = "none"
    assert schema_checks.admit(crd, explicit, old=old).errors == []
    edited = copy.deepcopy(old)
    edited["spec"]["source"]["uri"] = "pvc://models/chat/v1-retrained"
    with pytest.raises(schema_checks.Invalid) as caught:
        schema_checks.check_object(crd, edited, old=old)
    assert str(caught.value) == (
        'The ModelVersion "chat-v1" is invalid: spec: Invalid value: "object": '
        "spec is immutable; create a new ModelVersion instead"
    )


def test_cel_sees_the_declared_type_of_a_number():
    schema = {
        "type": "object",
        "properties": {"fraction": {"type": "number"}},
        "x-kubernetes-validations": [{"rule": "self.fraction <= 1.0", "message": "at most 1"}],
    }
    assert schema_checks.validate_cel(schema, {"fraction": 1}) == []
    (error,) = schema_checks.validate_cel(schema, {"fraction": 2}, "spec")
    assert str(error) == 'spec: Invalid value: "object": at most 1'


def test_several_errors_are_listed_like_kubectl(crd_files):
    obj = model(replicas={"min": 5, "max": 3}, traffic=[{"version": "v1", "weight": 90}])
    with pytest.raises(schema_checks.Invalid) as caught:
        schema_checks.check_object(crd_files["InferenceModel"], obj)
    assert str(caught.value).splitlines() == [
        'The InferenceModel "chat" is invalid: ',
        '* spec.traffic: Invalid value: "array": weights must sum to 100',
        '* spec.replicas: Invalid value: "object": min must be <= max',
    ]
    assert len(caught.value.errors) == 2


def test_the_operator_does_not_need_cel_python():
    code = (
        "import sys; import modelfleet.operator.schema_checks, modelfleet.operator.crdgen; "
        "sys.exit('celpy' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# cel-python sets its recursion limit when first used; hypothesis warns if that happens inside a test.
schema_checks.Cel.get()
versions = st.sampled_from(["v1", "v2", "V3"])
SPLITS = [
    [{"version": "v1", "weight": 100}],
    [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}],
    [{"version": "v1", "weight": 50}, {"version": "v1", "weight": 50}],
    [{"version": "v2", "weight": 0}, {"version": "v1", "weight": 100}],
]
specs = st.fixed_dictionaries(
    {
        "hardware": st.fixed_dictionaries(
            {"accelerator": st.sampled_from(["cpu", "nvidia-l4", "nvidia-l4", "gpu-x"])},
            optional={"count": st.integers(0, 17)},
        ),
        "traffic": st.one_of(
            st.sampled_from(SPLITS),
            st.lists(
                st.fixed_dictionaries({"version": versions, "weight": st.integers(-5, 105)}), max_size=3
            ),
        ),
    },
    optional={
        "replicas": st.fixed_dictionaries(
            {},
            optional={
                "min": st.sampled_from([-1, 0, 1, 2, 3, 1000, 1001]),
                "max": st.sampled_from([0, 1, 2, 3, 1000, 1001]),
            },
        ),
        "engine": st.fixed_dictionaries(
            {}, optional={"kvCacheMemoryFraction": st.sampled_from([0, 0.0, 0.5, 1, 1.0, 1.5])}
        ),
        "rollout": st.fixed_dictionaries(
            {"candidate": versions},
            optional={"steps": st.one_of(st.just([10, 50, 100]), st.lists(st.integers(0, 101), max_size=4))},
        ),
    },
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=specs)
def test_the_crd_and_the_pydantic_model_accept_the_same_specs(crd_files, spec):
    """What `modelfleet local up` refuses (the CRD) is exactly what the operator would refuse (pydantic)."""
    obj = {**model(), "spec": spec}
    errors = schema_checks.admit(crd_files["InferenceModel"], obj).errors
    try:
        validate_inference_model(obj)
        pydantic_error = None
    except InvalidResource as exc:
        pydantic_error = str(exc)
    assert (errors == []) == (pydantic_error is None), (errors, pydantic_error)
