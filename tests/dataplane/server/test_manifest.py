"""The serving manifest: the contract the operator renders and the server reads."""

from __future__ import annotations

import pytest
from modelfleet.dataplane.manifest import (
    ManifestError,
    Routing,
    ServedModel,
    ServedVersion,
    ServingManifest,
    load_manifest,
    single_model_manifest,
)

GOOD = """
models:
  - name: chat
    routing: {stickyBy: "header:X-Session"}
    engine: {max_model_len: 256}
    versions:
      - {name: v1, weight: 90, artifact: /models/v1, preload: true}
      - {name: v2, weight: 10, artifact: /models/v2, shadow_percent: 5}
  - name: embed
    versions:
      - {name: a, weight: 0, artifact: /models/a}
"""


def write(tmp_path, text: str):
    path = tmp_path / "manifest.yaml"
    path.write_text(text)
    return path


def test_load_good_manifest(tmp_path):
    manifest = load_manifest(write(tmp_path, GOOD))
    chat = manifest.model("chat")
    assert chat is not None
    assert [(v.name, v.weight, v.preload) for v in chat.versions] == [("v1", 90, True), ("v2", 10, False)]
    assert chat.version("v2").shadow_percent == 5
    assert chat.routing.sticky_kind == "header"
    assert chat.routing.sticky_header == "X-Session"
    assert chat.engine == {"max_model_len": 256}
    assert manifest.model("embed").routing.stickyBy == "none"
    assert manifest.model("missing") is None


def test_yaml_round_trip(tmp_path):
    manifest = load_manifest(write(tmp_path, GOOD))
    again = ServingManifest.from_yaml(manifest.to_yaml())
    assert again == manifest
    assert "stickyBy: header:X-Session" in manifest.to_yaml()


def test_built_in_python_matches_contract():
    manifest = ServingManifest(
        models=[ServedModel(name="m", versions=[ServedVersion(name="v1", weight=100, artifact="/a")])]
    )
    assert manifest.models[0].routing == Routing()
    assert manifest.models[0].engine == {}
    assert ServingManifest.from_yaml(manifest.to_yaml()) == manifest


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "models: [{name: m, versions: [{name: v, weight: 101, artifact: /a}]}]",
            "models[0].versions[0].weight: Input should be less than or equal to 100",
        ),
        (
            "models: [{name: m, versions: [{name: v, weight: -1, artifact: /a}]}]",
            "models[0].versions[0].weight: Input should be greater than or equal to 0",
        ),
        (
            "models: [{name: m, versions: [{name: a, weight: 60, artifact: /a},"
            " {name: b, weight: 30, artifact: /b}]}]",
            "models[0]: version weights must sum to 100 (or all be 0), got 90 (a=60, b=30)",
        ),
        (
            "models: [{name: m, versions: [{name: a, weight: 50, artifact: /a},"
            " {name: a, weight: 50, artifact: /b}]}]",
            "models[0]: version names must be unique within a model; repeated: a",
        ),
        (
            "models: [{name: m, versions: [{name: a, weight: 100, artifact: /a}]},"
            " {name: m, versions: [{name: a, weight: 100, artifact: /a}]}]",
            "model names must be unique; repeated: m",
        ),
        (
            "models: [{name: m, routing: {stickyBy: cookie},"
            " versions: [{name: a, weight: 100, artifact: /a}]}]",
            "models[0].routing.stickyBy: must be 'none', 'user' or 'header:<Name>', got 'cookie'",
        ),
        (
            "models: [{name: m, versions: [{name: a, weight: 100, artifact: /a, wieght: 3}]}]",
            "models[0].versions[0].wieght: unknown field; remove it or check its spelling",
        ),
        (
            "models: [{name: m, versions: [{name: a, weight: 100}]}]",
            "models[0].versions[0].artifact: required field is missing",
        ),
        (
            "models: [{name: m, versions: [{name: a@b, weight: 100, artifact: /a}]}]",
            "models[0].versions[0].name: must not contain '@'",
        ),
        ("models: [{name: m, versions: []}]", "models[0].versions: List should have at least 1 item"),
        (
            "models: [{name: m, versions: [{name: a, weight: 100, artifact: /a, shadow_percent: 200}]}]",
            "models[0].versions[0].shadow_percent: Input should be less than or equal to 100",
        ),
        ("- just a list", "top level must be a mapping"),
        ("models: [unclosed", "not valid YAML at line"),
    ],
)
def test_bad_manifest_is_one_clear_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"manifest {path}: ")
    assert expected in message


def test_all_zero_weights_allowed():
    manifest = ServingManifest.from_yaml(
        "models: [{name: m, versions: [{name: a, weight: 0, artifact: /a},"
        " {name: b, weight: 0, artifact: /b}]}]"
    )
    assert sum(v.weight for v in manifest.models[0].versions) == 0


def test_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="file not found"):
        load_manifest(tmp_path / "nope.yaml")


def test_empty_file_is_empty_manifest(tmp_path):
    assert load_manifest(write(tmp_path, "")).models == []


def test_several_problems_are_counted(tmp_path):
    text = "models: [{name: m, versions: [{name: a, weight: 300, artifact: /a, preload: maybe}]}]"
    with pytest.raises(ManifestError, match=r"and 1 more problem\)$"):
        load_manifest(write(tmp_path, text))


def test_single_model_manifest(tmp_path):
    model_dir = tmp_path / "My Model"
    manifest = single_model_manifest(model_dir)
    (model,) = manifest.models
    assert model.name == "My-Model"
    assert [(v.name, v.weight, v.preload, v.artifact) for v in model.versions] == [
        ("v1", 100, True, str(model_dir))
    ]
    assert single_model_manifest(model_dir, name="chat").models[0].name == "chat"
