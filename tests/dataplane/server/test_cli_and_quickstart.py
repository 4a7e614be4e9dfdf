"""`modelfleet serve` argument errors and the quickstart's manifest (no server started)."""

from __future__ import annotations

import pytest
from modelfleet.cli.commands import main
from modelfleet.dataplane.manifest import load_manifest
from modelfleet.dataplane.quickstart import examples, write_manifest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--manifest", "{missing}"], "file not found"),
        (["--manifest", "{bad}"], "models[0]: version weights must sum to 100"),
        (["--model", "{missing}"], "not a directory"),
        (["--model", "{tmp}", "--engine", "novalue"], "expected KEY=VALUE"),
    ],
)
def test_serve_refuses_bad_input_with_one_line(tmp_path, capsys, args, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: m, versions: [{name: a, weight: 30, artifact: /a}]}]")
    paths = {"missing": tmp_path / "missing", "bad": bad, "tmp": tmp_path}
    argv = ["serve", *(a.format(**paths) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert message in err


def test_quickstart_manifest_is_a_valid_50_50_split(tmp_path):
    path = write_manifest(tmp_path, tmp_path / "v1", tmp_path / "v2")
    (model,) = load_manifest(path).models
    assert model.name == "demo"
    assert [(v.name, v.weight, v.preload) for v in model.versions] == [("v1", 50, True), ("v2", 50, True)]
    text = examples("127.0.0.1", 8000)
    assert "curl -si http://127.0.0.1:8000/v1/completions" in text
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in text
