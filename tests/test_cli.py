"""The one console command lists exactly the subcommands that exist, and each of them answers --help."""

import subprocess
from pathlib import Path

import pytest
from modelfleet.cli.commands import SUBCOMMANDS, build_parser

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
