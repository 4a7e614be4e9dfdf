"""An artifact folder: staged under a temporary name, described by manifest.json, published by a rename;
and the compact JSON summary the operator reads from the Job's termination message."""

from __future__ import annotations

import glob
import json
import shutil
import tempfile
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from modelfleet.converters.errors import BadInputError
from modelfleet.converters.sources import folder_digest, to_pvc_uri
from modelfleet.dataplane.atomic import replace_folder

MANIFEST = "manifest.json"
SUMMARY_LIMIT = 4096  # a container's termination message is cut at 4 KiB
SUMMARY_VALIDATION_KEYS = (
    "passed",
    "maxAbsLogitDiff",
    "top1Agreement",
    "perplexityRelDiff",
    "method",
    "rule",
)


def converter_version() -> str:
    try:
        return metadata.version("modelfleet")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def check_parent(out: Path) -> None:
    """--out must be creatable: its nearest existing ancestor is a folder (checked before any download)."""
    existing = next((p for p in out.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise BadInputError(f"--out {out} lies under {existing}, which is not a folder")


def check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out {out} exists and is not a folder; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInputError(f"--out {out} is not empty; choose a new folder or pass --force to replace it")


def existing_manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def staging_dir(out: Path) -> Path:
    """A fresh staging folder beside `out`. A run killed outright (SIGKILL, OOM) cannot clean up after
    itself, so the staging folders an earlier run left for this `out` go first: one conversion per --out
    at a time (the operator runs one Job per target)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def write_manifest(staging: Path, fields: dict) -> dict:
    """Hash every file of the staged artifact and write manifest.json beside them; returns the manifest."""
    digest, files = folder_digest(staging, exclude=(MANIFEST,))
    manifest = {
        **fields,
        "sha256": digest.removeprefix("sha256:"),
        "sizeBytes": sum(f["size"] for f in files),
        "files": files,
        "converter": {"name": "modelfleet-convert", "version": converter_version()},
        "createdAt": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def publish(staging: Path, out: Path) -> None:
    """Rename the complete artifact into place; an old one (with --force) is moved aside first."""
    staging.chmod(0o755)
    for path in staging.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    replace_folder(staging, out)


def artifact_uri(out: Path) -> str:
    return to_pvc_uri(out) or out.absolute().as_uri()


def summary(*, ok: bool, target: dict, manifest: dict | None = None, uri: str | None = None,
            validation: dict | None = None, reason: str | None = None) -> dict:  # fmt: skip
    result: dict = {"ok": ok, **target, "uri": uri}
    if manifest:
        result["sha256"] = manifest["sha256"]
        result["sizeBytes"] = manifest["sizeBytes"]
    if validation:
        result["validation"] = {k: validation[k] for k in SUMMARY_VALIDATION_KEYS if k in validation}
    if reason:
        result["reason"] = reason
    return result


def summary_line(result: dict) -> str:
    """One compact JSON line under 4 KiB; an overlong reason is cut, never the fields the operator needs."""
    line = json.dumps(result, separators=(",", ":"))
    if len(line.encode()) >= SUMMARY_LIMIT and "reason" in result:
        excess = len(line.encode()) - SUMMARY_LIMIT + 16
        result = {**result, "reason": result["reason"][: max(0, len(result["reason"]) - excess)] + "..."}
        line = json.dumps(result, separators=(",", ":"))
    return line
