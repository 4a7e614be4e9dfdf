"""The one console command lists exactly the subcommands that exist, each answers --help, and a command
whose extra is not installed says which one."""

import subprocess
import sys
from pathlib import Path

import pytest
from modelfleet.cli.commands import EXTRAS, SUBCOMMANDS, build_parser, main
from modelfleet.dataplane.demo.cli import SIZE_NAMES
from modelfleet.operator import cli as operator_cli

MODELFLEET = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "modelfleet"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [str(MODELFLEET)] if MODELFLEET.exists() else ["python", "-m", "modelfleet.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for name in SUBCOMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_has_a_working_parser(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert name in capsys.readouterr().out


def test_no_subcommand_prints_help_and_fails():
    result = run_cli()
    assert result.returncode == 2
    assert "usage: modelfleet" in result.stdout


def test_building_the_parser_imports_no_component_library():
    """Each subcommand's parser module is argparse only: `modelfleet serve` must start where only the
    base package is installed, and `modelfleet --help` must not pay for torch or SQLAlchemy."""
    heavy = ("torch", "pydantic", "fastapi", "sqlalchemy", "alembic", "kopf", "kubernetes", "yaml", "numpy")
    code = (
        "import sys; from modelfleet.cli.commands import build_parser; build_parser(); "
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"building the parser imported {result.stdout.strip()}"


@pytest.fixture
def operator_extra_missing(monkeypatch):
    """As if kopf were installed but the rest of the operator extra were not."""
    monkeypatch.setitem(EXTRAS, "operator", ("kopf", "modelfleet_no_such_module"))

    def must_not_run(args):
        pytest.fail("the operator ran without its extra")

    monkeypatch.setattr(operator_cli, "run_operator", must_not_run)


def test_a_missing_extra_is_one_line_and_exit_2(operator_extra_missing, capsys):
    assert main(["operator", "--standalone"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "modelfleet operator: error: needs the 'operator' extra: pip install 'modelfleet[operator]'"
    ]


def test_help_needs_no_extra(operator_extra_missing, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["operator", "--help"])
    assert exit_info.value.code == 0
    assert "--standalone" in capsys.readouterr().out


def test_a_module_of_a_missing_extra_met_at_run_time_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(EXTRAS, "controlplane", ("sqlalchemy", "modelfleet_no_such_module"))

    def needs_sqlalchemy(args):
        raise ModuleNotFoundError(
            "No module named 'modelfleet_no_such_module'", name="modelfleet_no_such_module"
        )

    monkeypatch.setattr(operator_cli, "run_crds", needs_sqlalchemy)
    assert main(["crds"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "modelfleet crds: error: needs the 'controlplane' extra: pip install 'modelfleet[controlplane]'"
    ]


def test_a_missing_module_of_no_extra_is_not_blamed_on_one(monkeypatch):
    def broken(args):
        raise ModuleNotFoundError(
            "No module named 'modelfleet_no_such_module'", name="modelfleet_no_such_module"
        )

    monkeypatch.setattr(operator_cli, "run_crds", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["crds"])


def test_every_subcommand_names_a_known_extra():
    for name, command in SUBCOMMANDS.items():
        assert set(command.extras) <= set(EXTRAS), f"{name}: unknown extra in {command.extras}"


def test_demo_sizes_match_the_demo_model():
    from modelfleet.dataplane.demo.model import SIZES

    assert tuple(SIZES) == SIZE_NAMES


def test_every_missing_extra_is_named_at_once(monkeypatch, capsys):
    monkeypatch.setitem(EXTRAS, "operator", ("modelfleet_no_such_module",))
    monkeypatch.setitem(EXTRAS, "local", ("modelfleet_no_such_module",))
    assert main(["local", "status"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "modelfleet local: error: needs the 'operator' and 'local' extras: "
        "pip install 'modelfleet[operator,local]'"
    ]
