"""`modelfleet convert`: what a ModelVersion's conversion Job runs.

The last stdout line is a compact JSON summary (also written to --termination-log or
$MODELFLEET_TERMINATION_LOG, the container's termination-message path); logs and progress go to stderr.
Every failure prints one `error: ...` line on stderr and a summary with "ok": false and the "reason", never
a traceback, and exits with one of EXIT_CODES; nothing is published (the staging folder is removed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from modelfleet.converters.formats import ACCELERATORS, DTYPES, FORMATS

TERMINATION_LOG_ENV = "MODELFLEET_TERMINATION_LOG"
# The operator reads these (operator/reconcile/conversion.py): 1 may be transient and is retried.
EXIT_CODES = {
    0: "published (or already published by an earlier run)",
    1: "conversion failed (an I/O or network error, or an unexpected one; may be transient)",
    2: "bad input: the source, the arguments or a setting is wrong",
    3: "a tool this conversion needs is not installed (TensorRT, s3fs)",
    4: "validation failed: the artifact does not match its source",
    130: "interrupted (SIGINT)",
    143: "terminated (SIGTERM)",
}
EPILOG = (
    "exit codes:\n"
    + "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES.items())
    + (
        "\n\nhttp(s) sources: private, loopback and link-local hosts are refused unless listed in\n"
        "MODELFLEET_SOURCE_ALLOW_HOSTS (see converters/README.md)."
    )
)


class Terminated(BaseException):
    """SIGTERM (a Job's deadline, a deleted pod): unwinds like Ctrl-C, so the staging folder is removed."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a model into a validated per-hardware artifact",
        description="Convert a Hugging Face safetensors model into an artifact for one hardware class, "
        "validate it against the source and publish it atomically.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.error = functools.partial(_usage_error, parser)  # type: ignore[method-assign]  (a summary too)
    parser.add_argument(
        "--source",
        required=True,
        help="file://, a folder, pvc://CLAIM/PATH, http(s)://, s3://, hf://ORG/NAME[@REVISION]",
    )
    parser.add_argument("--target", required=True, choices=ACCELERATORS, metavar="ACCELERATOR",
                        help=f"hardware class: {', '.join(ACCELERATORS)}")  # fmt: skip
    parser.add_argument("--format", choices=FORMATS, help="default: the hardware's preferred format")
    parser.add_argument("--dtype", choices=DTYPES, help="default: the hardware's serving dtype")
    parser.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="int8/fp8 targets: quantize lm_head too, per vocabulary row (default: it stays in the "
        "serving dtype, as the logits' quality depends on it)",
    )
    parser.add_argument("--out", required=True, type=Path, help="artifact folder to publish")
    parser.add_argument("--sha256", help="expected source digest (archive sha256, or the folder digest)")
    parser.add_argument(
        "--cache-dir", type=Path, help="downloads (resumable); default: OUT/../.modelfleet-cache"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing artifact at --out")
    parser.add_argument("--termination-log", type=Path, default=os.environ.get(TERMINATION_LOG_ENV) or None,
                        help=f"also write the summary here (default: ${TERMINATION_LOG_ENV})")  # fmt: skip
    parser.set_defaults(func=run)


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """An argument error: argparse's usage line, then the one error line and the failed summary."""
    parser.print_usage(sys.stderr)
    print(f"error: {message}", file=sys.stderr)
    from modelfleet.converters import artifact

    target = {"accelerator": None, "format": None, "dtype": None}
    line = artifact.summary_line(artifact.summary(ok=False, target=target, reason=message))
    _report(line, os.environ.get(TERMINATION_LOG_ENV))
    sys.exit(2)


def _report(line: str, termination_log: str | Path | None) -> None:
    if termination_log:
        try:
            Path(termination_log).write_text(line + "\n")
        except OSError as exc:
            print(f"warning: cannot write termination log {termination_log}: {exc}", file=sys.stderr)
    print(line, flush=True)


def _terminate(signum: int, frame: object) -> NoReturn:
    raise Terminated


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
        quantize_lm_head=args.quantize_lm_head,
    )
    code, validation = 0, None
    # Only the main thread may set a handler (an in-process caller on another thread keeps its own).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        result = convert(request)
    except ConversionError as exc:
        reason, code = _first_line(exc), exc.exit_code
        validation = exc.validation if isinstance(exc, ValidationFailedError) else None
    except KeyboardInterrupt:
        reason, code = "interrupted", 130
    except Terminated:
        reason, code = "terminated (SIGTERM)", 143
    except OSError as exc:  # a disk, a mount or the network failed under us: perhaps transient
        reason, code = _first_line(exc), 1
    except Exception as exc:  # a bug or a case no check foresaw: still one line and a summary
        reason, code = f"unexpected {type(exc).__name__}: {_first_line(exc)}", 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if code:
        if validation is not None:  # the whole report (the summary keeps a few figures): why it failed
            print(f"validation report: {json.dumps(validation)}", file=sys.stderr)
        print(f"error: {reason}", file=sys.stderr)
        result = artifact.summary(ok=False, target=target, validation=validation, reason=reason)
    _report(artifact.summary_line(result), args.termination_log)
    return code


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
