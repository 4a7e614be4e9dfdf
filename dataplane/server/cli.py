"""`modelfleet serve --manifest FILE | --model DIR [--host H] [--port P]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve models over an OpenAI-compatible API",
        description="Serve the models of a serving manifest (or one model folder) over an OpenAI-compatible "
        "API, with /health, /ready and /metrics. Settings also come from MODELFLEET_* variables.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifest", type=Path, help="serving manifest (YAML); watched for changes")
    source.add_argument("--model", type=Path, help="one model folder, served as one version")
    parser.add_argument("--name", help="model name clients use with --model (default: the folder name)")
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine setting for --model, e.g. max_model_len=512 (value parsed as JSON when it can be)",
    )
    parser.add_argument("--host", help="address to listen on (default 0.0.0.0, or MODELFLEET_HOST)")
    parser.add_argument("--port", type=int, help="port (default 8000, or MODELFLEET_PORT)")
    parser.add_argument(
        "--grpc-port",
        type=int,
        help="also serve the gRPC API on this port (default off, or MODELFLEET_GRPC_PORT)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=handle)


def _engine_settings(pairs: list[str]) -> dict:
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine {pair!r}: expected KEY=VALUE, e.g. max_model_len=512")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


def handle(args: argparse.Namespace) -> int:
    # The server's libraries only when it runs: building the `modelfleet` parser stays cheap.
    import uvicorn
    from modelfleet.dataplane.manifest import ManifestError, ServedModel, load_manifest, single_model_manifest
    from modelfleet.dataplane.observability import configure_logging
    from modelfleet.dataplane.server.auth import KeyFileError
    from modelfleet.dataplane.server.connections import uvicorn_config
    from modelfleet.dataplane.server.runtime import build_app
    from modelfleet.dataplane.server.settings import ServerSettings
    from pydantic import ValidationError

    configure_logging(args.log_level)
    try:
        settings = ServerSettings()
        given = (("host", args.host), ("port", args.port), ("grpc_port", args.grpc_port))
        overrides = {k: v for k, v in given if v is not None}
        settings = settings.model_copy(update=overrides)
        if args.manifest is not None:
            manifest_path = args.manifest
            manifest = load_manifest(manifest_path)
        else:
            if not args.model.is_dir():
                raise ManifestError(f"--model {args.model}: not a directory; pass a model folder")
            manifest_path = None
            manifest = single_model_manifest(args.model, name=args.name)
            model = manifest.models[0]
            manifest.models[0] = ServedModel(
                name=model.name, versions=model.versions, engine=_engine_settings(args.engine)
            )
        app = build_app(settings, manifest, manifest_path=manifest_path)
    except (ManifestError, KeyFileError, ValueError) as exc:
        message = str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else _settings_error(exc)
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(f"modelfleet serve: http://{settings.host}:{settings.port}/v1 ({len(manifest.models)} model(s))")
    if settings.grpc_port:
        print(f"modelfleet serve: gRPC {settings.host}:{settings.grpc_port} (modelfleet.v1.Inference)")
    uvicorn.Server(uvicorn_config(app, settings, log_level=args.log_level)).run()
    return 0


def _settings_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"])
    return f"MODELFLEET_{field.upper()}: {err['msg']}"
