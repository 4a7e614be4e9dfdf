"""The parsers of `modelfleet operator` and `modelfleet crds`.

argparse only: building the `modelfleet` command must not import kopf, the Kubernetes client or pydantic.
Each handler imports its module (main.py, crdgen.py) when the command runs.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "operator", help="run the Kubernetes operator (InferenceModel and ModelVersion controllers)"
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        metavar="NS",
        help="serve this namespace (repeatable); default: MODELFLEET_OPERATOR_NAMESPACES, else all",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    parser.add_argument("--peering", help="kopf peering name (default: MODELFLEET_OPERATOR_PEERING)")
    parser.add_argument(
        "--standalone", action="store_true", help="run without peering (one replica only; development)"
    )
    parser.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    from modelfleet.operator import main

    return main._run(args)


def add_crds_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "crds", help="write the CustomResourceDefinitions generated from the API models"
    )
    parser.add_argument("--out", default="crds", help="directory for the CRD files (default: crds)")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the files in --out are stale"
    )
    parser.set_defaults(func=run_crds)


def run_crds(args: argparse.Namespace) -> int:
    from modelfleet.operator import crdgen

    return crdgen._run(args)
