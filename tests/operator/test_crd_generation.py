"""The CRDs in crds/ are generated from operator/api.py, up to date, structural and valid manifests."""

from __future__ import annotations

import argparse

import kubernetes_validate
import pytest
from modelfleet.operator import api, cli, crd_checks, crdgen, schema_checks


def test_checked_in_crds_match_the_models(repo_root):
    stale = crdgen.stale_files(repo_root / "crds")
    assert not stale, f"crds/ is stale ({stale}); run `modelfleet crds --out crds`"


def run_crds(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="modelfleet")
    cli.add_crds_parser(parser.add_subparsers())
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
    # The API server lets a CRD restrict only name/generateName of metadata; we restrict nothing.
    assert root["properties"]["metadata"] == {"type": "object"}
    assert set(root["properties"]) == {"apiVersion", "kind", "metadata", "spec", "status"}
    assert [str(e) for e in crd_checks.schema_errors(root, "openAPIV3Schema")] == []


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


def _rules(node):
    """(schema, rule) for every CEL rule under `node`."""
    found = [(node, v["rule"]) for v in node.get("x-kubernetes-validations", [])]
    for sub in node.get("properties", {}).values():
        found += _rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found += _rules(node[key])
    return found


def test_cel_rules_compile_and_cover_the_cross_field_rules(schemas):
    found = _rules(schemas["InferenceModel"]) + _rules(schemas["ModelVersion"])
    for node, rule in found:
        assert crd_checks.check_rule(node, rule).error == "", rule
    rules = [rule for _, rule in found]
    assert "self.map(t, t.weight).sum() == 100" in rules
    assert "!has(self.min) || !has(self.max) || self.min <= self.max" in rules
    assert "self == oldSelf" in [rule for _, rule in _rules(schemas["ModelVersion"]["properties"]["spec"])]


def test_defaults_validate_and_agree_with_the_pydantic_defaults(crd_files):
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
    admitted = schema_checks.admit(crd_files["InferenceModel"], minimal)
    assert admitted.errors == [] and admitted.warnings == []
    defaulted = admitted.object
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
    assert schema_checks.validate_cel(spec_schema, spec, "spec", old=dict(spec)) == []
    edited = {**spec, "source": {"uri": "pvc://models/chat/v1-retrained"}}
    assert [str(e) for e in schema_checks.validate_cel(spec_schema, edited, "spec", old=spec)] == [
        'spec: Invalid value: "object": spec is immutable; create a new ModelVersion instead'
    ]
