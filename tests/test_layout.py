"""The package layout: one `modelfleet` namespace over the top-level folders, stdlib never shadowed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_stdlib_operator_is_not_shadowed_from_repo_root():
    result = run_python("import operator; print(operator.itemgetter(1)(['a', 'b']), operator.__file__)", ROOT)
    assert result.returncode == 0, result.stderr
    answer, origin = result.stdout.split()
    assert answer == "b"
    assert not origin.startswith(str(ROOT))


def test_parts_import_from_any_directory(tmp_path):
    code = "import modelfleet.operator, modelfleet.dataplane, modelfleet.converters, modelfleet.controlplane"
    for cwd in (ROOT, tmp_path):
        result = run_python(code, cwd)
        assert result.returncode == 0, f"from {cwd}: {result.stderr}"


def test_plain_install_works(tmp_path):
    """A non-editable install (a built wheel's layout) imports and runs the CLI outside the checkout."""
    target = tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    assert (target / "modelfleet" / "operator").is_dir()
    code = (
        "import modelfleet.operator, modelfleet.dataplane, modelfleet.cli.commands as c; "
        "print(modelfleet.cli.__file__)"
    )
    env_path = f"import sys; sys.path.insert(0, {str(target)!r}); "
    result = run_python(env_path + code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target))
