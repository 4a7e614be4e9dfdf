"""The one console command, `modelfleet`, with a subcommand per component.

Each subcommand lives with its component and registers itself here through `add_parser`; a subcommand is
listed only once the component behind it works.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import modelfleet.cli
from modelfleet.cli import __version__

# subcommand -> module that defines `add_parser(subparsers)`; each sets `func` on its parser.
SUBCOMMANDS = {
    "demo": "modelfleet.dataplane.demo.cli",
    "crds": "modelfleet.operator.crdgen",
    "operator": "modelfleet.operator.main",
    "serve": "modelfleet.dataplane.server.cli",
    "convert": "modelfleet.converters.cli",
    "controlplane": "modelfleet.controlplane.main",
    "local": "modelfleet.local.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet", description=modelfleet.cli.__doc__)
    parser.add_argument("--version", action="version", version=f"modelfleet {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        # Errors a user can fix (bad input, missing or existing files): one line, no traceback.
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"modelfleet {args.command}: error: {first_line}", file=sys.stderr)
        return 2
