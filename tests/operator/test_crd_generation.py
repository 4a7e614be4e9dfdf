"""The CRDs in crds/ are generated from operator/api.py, up to date, structural and valid manifests."""

from __future__ import annotations

import argparse

import kubernetes_validate
import pytest
from crd_checks import (
    all_rules,
    apply_defaults,
    cel_violations,
    compile_rule,
    schema_errors,
    structural_problems,
)
from modelfleet.operator import api, crdgen


def test_checked_in_crds_match_the_models(repo_root):
    stale = crdgen.stale_files(repo_root / "crds")
    assert not stale, f"crds/ is stale ({stale}); run `modelfleet crds --out crds`"


def run_crds(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="modelfleet")
    crdgen.add_parser(parser.add_subparsers())
    args = parser.parse_args(["crds", *argv])
    return args.func(args)


def test_check_flag_fails_on_stale_files_and_write_fixes_them(tmp_path, capsys):
    (tmp_path / "inferencemodels.modelfleet.dev.yaml").write_text("stale: true\n")
    assert run_crds("--out", str(tmp_path), "--check") == 1
    error = capsys.readouterr().err
    assert "inferencemodels.modelfleet.dev.yaml" in error
    assert "modelversions.modelfleet.dev.yaml" in error  # missing counts as stale
    assert "run `modelfleet crds --out" in error
    assert run_crds("--out", str(tmp_path)) == 0
    assert run_crds("--out", str(tmp_path), "--check") == 0
    assert crdgen.stale_files(tmp_path) == []


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.37.0"])
def test_crds_pass_kubernetes_validate_strict(crd_files, k8s_version):
    for crd in crd_files.values():
        kubernetes_validate.validate(crd, k8s_version, strict=True)  # raises on any problem


@pytest.mark.parametrize("kind", ["InferenceModel", "ModelVersion"])
def test_schemas_are_structural(schemas, kind):
    root = schemas[kind]
    assert root["type"] == "object"
    # Only type: object is allowed on metadata beyond name/generateName restrictions.
    assert root["properties"]["metadata"] == {"type": "object"}
    assert set(root["properties"]) == {"apiVersion", "kind", "metadata", "spec", "status"}
    problems = []
    for part in ("spec", "status"):
        problems += structural_problems(root["properties"][part], part)
    assert problems == []


def test_structural_check_catches_what_the_api_server_rejects():
    bad = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "b": {"type": "string"},
            "c": {"type": "array", "items": {"$ref": "#/x"}, "uniqueItems": True},
        },
    }
    problems = "\n".join(structural_problems(bad, "spec"))
    for expected in (
        "spec.a: keyword 'anyOf'",
        "spec.b: string without maxLength",
        "spec.c: keyword 'uniqueItems'",
        "spec.c: array without maxItems",
        "spec.c[]: keyword '$ref'",
    ):
        assert expected in problems


def test_preserve_unknown_fields_only_for_the_free_form_validation_report(schemas):
    def free_form(node, path):
        found = [path] if node.get("x-kubernetes-preserve-unknown-fields") else []
        for name, sub in node.get("properties", {}).items():
            found += free_form(sub, f"{path}.{name}")
        if "items" in node:
            found += free_form(node["items"], f"{path}[]")
        return found

    assert free_form(schemas["InferenceModel"], "") == []
    assert free_form(schemas["ModelVersion"], "") == [".status.artifacts[].validation"]


def test_names_status_subresource_and_printer_columns(crd_files):
    im, mv = crd_files["InferenceModel"], crd_files["ModelVersion"]
    for crd, short, plural in ((im, "im", "inferencemodels"), (mv, "mv", "modelversions")):
        assert crd["metadata"]["name"] == f"{plural}.modelfleet.dev"
        assert crd["spec"]["group"] == "modelfleet.dev"
        assert crd["spec"]["names"]["shortNames"] == [short]
        assert crd["spec"]["names"]["categories"] == ["modelfleet"]
        (version,) = crd["spec"]["versions"]
        assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
        assert version["subresources"] == {"status": {}}
    columns = lambda crd: [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]  # noqa: E731
    assert columns(im) == ["Accelerator", "Traffic", "Ready", "Endpoint", "Rollout", "Age"]
    assert columns(mv) == ["Model", "Version", "Phase", "Age"]


def test_cel_rules_compile_and_cover_the_cross_field_rules(schemas):
    rules = all_rules(schemas["InferenceModel"]) + all_rules(schemas["ModelVersion"])
    for rule in rules:
        compile_rule(rule)  # raises CELParseError on a malformed rule
    assert "self.map(t, t.weight).sum() == 100" in rules
    assert "self.min <= self.max" in rules
    assert "self == oldSelf" in all_rules(schemas["ModelVersion"]["properties"]["spec"])


def test_defaults_validate_and_agree_with_the_pydantic_defaults(schemas):
    """What the API server fills in equals what pydantic assumes, and passes the schema and CEL rules."""
    minimal = {
        "apiVersion": api.API_VERSION,
        "kind": "InferenceModel",
        "metadata": {"name": "m"},
        "spec": {
            "hardware": {"accelerator": "cpu"},
            "traffic": [{"version": "v1", "weight": 100}],
            "rollout": {"candidate": "v1"},
        },
    }
    schema = schemas["InferenceModel"]
    defaulted = apply_defaults(schema, minimal)
    assert schema_errors(schema, defaulted) == []
    assert cel_violations(schema, defaulted) == []
    parsed = api.InferenceModel.model_validate(minimal)
    assert defaulted["spec"] == _without_empty(parsed.spec.model_dump(by_alias=True, exclude_none=True))
    assert defaulted["spec"]["replicas"] == {"min": 1, "max": 1}
    assert defaulted["spec"]["rollout"]["steps"] == [10, 50, 100]


def _without_empty(value):
    """Empty lists and maps: pydantic fills them in, the API server leaves them out; both mean 'none'."""
    if isinstance(value, dict):
        return {k: _without_empty(v) for k, v in value.items() if v not in ({}, [])}
    return value


def test_model_version_spec_is_immutable(schemas):
    spec_schema = schemas["ModelVersion"]["properties"]["spec"]
    spec = {"model": "chat", "version": "v1", "source": {"uri": "pvc://models/chat/v1"}}
    assert cel_violations(spec_schema, spec, "spec", old=dict(spec)) == []
    edited = {**spec, "source": {"uri": "pvc://models/chat/v1-retrained"}}
    assert cel_violations(spec_schema, edited, "spec", old=spec) == [
        "spec: spec is immutable; create a new ModelVersion instead"
    ]
