"""`modelfleet convert`: what a ModelVersion's conversion Job runs.

The last stdout line is a compact JSON summary (also written to --termination-log or
$MODELFLEET_TERMINATION_LOG, the container's termination-message path); logs and progress go to stderr.
Exit codes: 0 published, 1 conversion failed, 2 bad input, 3 a needed tool is missing, 4 validation failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from modelfleet.converters.formats import ACCELERATORS, DTYPES, FORMATS

TERMINATION_LOG_ENV = "MODELFLEET_TERMINATION_LOG"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a model into a validated per-hardware artifact",
        description="Convert a Hugging Face safetensors model into an artifact for one hardware class, "
        "validate it against the source and publish it atomically.",
    )
    parser.add_argument(
        "--source", required=True, help="file://, a folder, pvc://CLAIM/PATH, http(s)://, s3://"
    )
    parser.add_argument("--target", required=True, choices=ACCELERATORS, metavar="ACCELERATOR",
                        help=f"hardware class: {', '.join(ACCELERATORS)}")  # fmt: skip
    parser.add_argument("--format", choices=FORMATS, help="default: the hardware's preferred format")
    parser.add_argument("--dtype", choices=DTYPES, help="default: the hardware's serving dtype")
    parser.add_argument("--out", required=True, type=Path, help="artifact folder to publish")
    parser.add_argument("--sha256", help="expected source digest (archive sha256, or the folder digest)")
    parser.add_argument(
        "--cache-dir", type=Path, help="downloads (resumable); default: OUT/../.modelfleet-cache"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing artifact at --out")
    parser.add_argument("--termination-log", type=Path, default=os.environ.get(TERMINATION_LOG_ENV) or None,
                        help=f"also write the summary here (default: ${TERMINATION_LOG_ENV})")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Heavy imports (torch, transformers) only when a conversion really runs, not for `--help`.
    from modelfleet.converters import artifact
    from modelfleet.converters.convert import Request, convert, resolve_target
    from modelfleet.converters.errors import ConversionError, ValidationFailedError

    try:
        target = resolve_target(args.target, args.format, args.dtype).as_dict()
    except ConversionError:
        target = {"accelerator": args.target, "format": args.format, "dtype": args.dtype}
    request = Request(
        source=args.source,
        accelerator=args.target,
        out=args.out,
        format=args.format,
        dtype=args.dtype,
        sha256=args.sha256,
        cache_dir=args.cache_dir,
        force=args.force,
    )
    code = 0
    try:
        result = convert(request)
    except ConversionError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {reason}", file=sys.stderr)
        validation = exc.validation if isinstance(exc, ValidationFailedError) else None
        result = artifact.summary(ok=False, target=target, validation=validation, reason=reason)
        code = exc.exit_code
    except KeyboardInterrupt:
        result, code = artifact.summary(ok=False, target=target, reason="interrupted"), 130
    line = artifact.summary_line(result)
    if args.termination_log:
        try:
            Path(args.termination_log).write_text(line + "\n")
        except OSError as exc:
            print(f"warning: cannot write termination log {args.termination_log}: {exc}", file=sys.stderr)
    print(line, flush=True)
    return code
