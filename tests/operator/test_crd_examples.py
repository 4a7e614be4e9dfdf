"""examples/model.yaml passes both the CRD schemas and the pydantic models; each bad example fails both,
with a message that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from modelfleet.operator import schema_checks
from modelfleet.operator.api import InferenceModel, ModelVersion
from modelfleet.operator.validation import InvalidResource, validate_resource

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# bad example -> the field its error must name
BAD = {
    "weights-sum-90.yaml": "spec.traffic",
    "duplicate-version.yaml": "spec.traffic",
    "unknown-accelerator.yaml": "spec.hardware.accelerator",
    "replicas-min-above-max.yaml": "spec.replicas",
    "bad-uri-scheme.yaml": "spec.source.uri",
    "missing-source.yaml": "spec.source",
}


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def api_server_errors(crd_files: dict, obj: dict) -> list[str]:
    """What the API server would say to a create of `obj`: its field errors, as kubectl prints them."""
    return [str(e) for e in schema_checks.admit(crd_files[obj["kind"]], obj).errors]


def test_every_bad_case_has_an_example():
    assert sorted(p.name for p in (EXAMPLES / "bad").glob("*.yaml")) == sorted(BAD)


def test_model_example_is_valid_for_the_api_server_and_the_models(crd_files):
    docs = load(EXAMPLES / "model.yaml")
    assert [d["kind"] for d in docs] == ["InferenceModel", "ModelVersion", "ModelVersion"]
    for doc in docs:
        assert api_server_errors(crd_files, doc) == [], doc["metadata"]["name"]
    model, v1, v2 = (validate_resource(doc) for doc in docs)
    assert isinstance(model, InferenceModel) and isinstance(v1, ModelVersion)
    assert model.spec.hardware.accelerator == "nvidia-h100"
    assert {t.version: t.weight for t in model.spec.traffic} == {"v1": 90, "v2": 10}
    assert {(v.spec.model, v.spec.version) for v in (v1, v2)} == {("chat", "v1"), ("chat", "v2")}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_example_is_rejected_by_the_models_naming_the_field(name):
    (doc,) = load(EXAMPLES / "bad" / name)
    with pytest.raises(InvalidResource) as caught:
        validate_resource(doc)
    assert caught.value.field == BAD[name]
    message = str(caught.value)
    assert f": {BAD[name]}: " in message and "\n" not in message


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_example_is_rejected_by_the_crd_schema_naming_the_field(crd_files, name):
    (doc,) = load(EXAMPLES / "bad" / name)
    errors = api_server_errors(crd_files, doc)
    field = BAD[name]
    parent, leaf = field.rsplit(".", 1)
    assert any(
        e.startswith(f"{field}:")
        or e.startswith(f"{field}[")
        or (e.startswith(f"{parent}:") and repr(leaf) in e)
        for e in errors
    ), errors
