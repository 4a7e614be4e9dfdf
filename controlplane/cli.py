"""The parser of `modelfleet controlplane`.

argparse only: building the `modelfleet` command must not import FastAPI or SQLAlchemy (the latter comes
with the `controlplane` extra). The handler imports main.py when the command runs.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "controlplane",
        help="run the control plane: tenants, API keys, model registry, rollouts",
        description="Serve the control plane's REST API (/api/v1, OpenAPI at /docs). Settings come from "
        "MODELFLEET_CONTROLPLANE_* variables (MODELFLEET_CONTROLPLANE_DATABASE_URL or DATABASE_URL, "
        "MODELFLEET_CONTROLPLANE_ADMIN_KEY, ...).",
    )
    parser.add_argument(
        "--host",
        default=None,
        help="address to listen on (default: MODELFLEET_CONTROLPLANE_HOST or 127.0.0.1)",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="port (default: MODELFLEET_CONTROLPLANE_PORT or 8080)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--migrate-only",
        action="store_true",
        help="bring the database schema to head (alembic upgrade head) and exit: once per release (the "
        "chart's migration Job); replicas with MODELFLEET_CONTROLPLANE_MIGRATE_ON_START=false wait for it",
    )
    parser.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from modelfleet.controlplane import main

    return main.serve(args)
