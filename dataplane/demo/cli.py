"""`modelfleet demo create DIR`: write the demo model."""

from __future__ import annotations

import argparse
import sys
import time

# The names of demo.model.SIZES, which imports torch (tests/test_cli.py checks they agree).
SIZE_NAMES = ("tiny", "small")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="create a demo model (random weights) for tests and benchmarks")
    actions = demo.add_subparsers(dest="demo_command", metavar="ACTION", required=True)
    create = actions.add_parser(
        "create", help="write a random-weight Llama checkpoint and tokenizer into DIR"
    )
    create.add_argument("dir", metavar="DIR", help="output folder (must be empty or absent unless --force)")
    create.add_argument("--size", choices=SIZE_NAMES, default="tiny", help="tiny: <1M params; small: ~100M")
    create.add_argument("--seed", type=int, default=0, help="weights seed; two seeds make two versions")
    create.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    create.set_defaults(func=run_create)


def run_create(args: argparse.Namespace) -> int:
    from modelfleet.dataplane.demo.model import create_demo_model

    started = time.monotonic()
    try:
        out = create_demo_model(args.dir, size=args.size, seed=args.seed, force=args.force)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.size} demo model (seed {args.seed}) to {out} in {time.monotonic() - started:.1f}s")
    return 0
