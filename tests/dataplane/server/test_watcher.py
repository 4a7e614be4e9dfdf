"""The manifest watcher applies a change only once the file has stopped changing."""

from pathlib import Path

from modelfleet.dataplane.server.watcher import ManifestWatcher


def manifest(weight_a: int) -> str:
    return (
        f"models: [{{name: m, versions: [{{name: a, weight: {weight_a}, artifact: /a}}, "
        f"{{name: b, weight: {100 - weight_a}, artifact: /b}}]}}]\n"
    )


def make_watcher(path: Path):
    applied, results = [], []
    watcher = ManifestWatcher(path, applied.append, on_result=results.append)
    return watcher, applied, results


def test_a_change_is_applied_when_two_checks_agree(tmp_path):
    path = tmp_path / "manifest.yaml"
    path.write_text(manifest(100))
    watcher, applied, results = make_watcher(path)
    assert not watcher.check()  # unchanged
    path.write_text(manifest(30))
    assert not watcher.check()  # seen once: maybe still being written
    assert watcher.check()
    assert [v.weight for v in applied[0].models[0].versions] == [30, 70]
    assert results == ["applied"]
    assert not watcher.check()  # applied once only


def test_a_truncated_or_half_written_file_is_never_applied(tmp_path):
    path = tmp_path / "manifest.yaml"
    path.write_text(manifest(100))
    watcher, applied, results = make_watcher(path)
    path.write_text("")  # an editor truncating before it writes
    assert not watcher.check() and not watcher.check()
    path.write_text(manifest(40)[:30])  # caught mid-write: differs at the next check
    assert not watcher.check()
    path.write_text(manifest(40))
    assert not watcher.check()
    assert watcher.check()
    assert applied and [v.weight for v in applied[-1].models[0].versions] == [40, 60]
    assert results == ["applied"]


def test_an_invalid_manifest_is_counted_and_not_applied(tmp_path):
    path = tmp_path / "manifest.yaml"
    path.write_text(manifest(100))
    watcher, applied, results = make_watcher(path)
    path.write_text(manifest(100).replace("weight: 0", "weight: 20"))  # sums to 120
    watcher.check()
    assert not watcher.check()
    assert applied == [] and results == ["invalid"]


def test_a_blank_file_never_unloads_the_models_but_an_explicit_empty_list_does(tmp_path):
    path = tmp_path / "manifest.yaml"
    path.write_text(manifest(100))
    watcher, applied, results = make_watcher(path)
    path.write_text(" \n\t\n")
    assert not watcher.check() and not watcher.check()
    assert applied == [] and results == []
    path.write_text("models: []\n")
    assert not watcher.check() and watcher.check()
    assert applied[0].models == []
