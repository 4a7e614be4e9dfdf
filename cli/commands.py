"""The one console command, `modelfleet`, with a subcommand per component.

Each subcommand's parser lives with its component, in a module that imports only the standard library at
its top (its handler imports the component when the command runs): building the parser must work where
only the base package, the data plane, is installed. A subcommand is listed only once the component
behind it works.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass

import modelfleet.cli
from modelfleet.cli import __version__


@dataclass(frozen=True)
class Subcommand:
    module: str  # defines `function(subparsers)`, which adds the subcommand and sets `func` on its parser
    function: str = "add_parser"
    extras: tuple[str, ...] = ()  # the optional extras of pyproject.toml it needs; (): the base package


# One line per subcommand.
SUBCOMMANDS = {
    "demo": Subcommand("modelfleet.dataplane.demo.cli"),
    "serve": Subcommand("modelfleet.dataplane.server.cli"),
    "convert": Subcommand("modelfleet.converters.cli"),
    "crds": Subcommand("modelfleet.operator.cli", function="add_crds_parser"),
    "operator": Subcommand("modelfleet.operator.cli", extras=("operator",)),
    "controlplane": Subcommand("modelfleet.controlplane.cli", extras=("controlplane",)),
    "local": Subcommand("modelfleet.local.cli", extras=("operator", "local")),
}

# extra -> the top-level modules its requirements install (tests/test_packaging.py checks the two agree).
EXTRAS = {
    "operator": ("kopf", "kubernetes"),
    "controlplane": ("sqlalchemy", "alembic", "psycopg", "kubernetes"),
    "local": ("celpy",),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet", description=modelfleet.cli.__doc__)
    parser.add_argument("--version", action="version", version=f"modelfleet {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in SUBCOMMANDS.values():
        getattr(importlib.import_module(command.module), command.function)(subparsers)
    return parser


def missing_extras(extras: tuple[str, ...]) -> list[str]:
    """The extras of which some module is not installed (found without importing any)."""
    return [e for e in extras if any(importlib.util.find_spec(name) is None for name in EXTRAS[e])]


def extra_providing(module: str | None) -> str | None:
    """The extra whose requirements install the top-level package of `module`, if any."""
    top = (module or "").partition(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def _needs_extras(command: str, extras: list[str]) -> int:
    names = " and ".join(f"'{extra}'" for extra in extras) + (" extras" if len(extras) > 1 else " extra")
    print(
        f"modelfleet {command}: error: needs the {names}: pip install 'modelfleet[{','.join(extras)}]'",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    missing = missing_extras(SUBCOMMANDS[args.command].extras)
    if missing:
        return _needs_extras(args.command, missing)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        # A command that reaches into another component's extra says which one, not a traceback.
        extra = extra_providing(exc.name)
        if extra is None or not missing_extras((extra,)):
            raise
        return _needs_extras(args.command, [extra])
    except (ValueError, OSError) as exc:
        # Errors a user can fix (bad input, missing or existing files): one line, no traceback.
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"modelfleet {args.command}: error: {first_line}", file=sys.stderr)
        return 2
