"""What the converter reads stays inside its source: names are checked, paths resolved, files stat-ed first.

A checkpoint is written by someone else. Its index names the shard files, and its folder may hold symlinks,
FIFOs, sockets or devices. So a shard name must be a plain `*.safetensors` file name (no folder part, no
`..`, not absolute, no backslash or NUL, not hidden), and a file is opened only after its resolved path is
found inside the resolved source folder and `os.stat` says it is a regular file: a symlink never reads a
file from elsewhere, and a FIFO never blocks the converter.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from modelfleet.converters.errors import BadInputError

INDEX = "model.safetensors.index.json"
SHARD_SUFFIX = ".safetensors"
NAME_MAX = 255  # bytes, as most file systems


def _plain(name: object) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and not any(c in name for c in "/\\\0")
        and not name.startswith(".")  # also '.' and '..'; hidden files are outside the source digest
        and len(name.encode()) <= NAME_MAX
    )


def check_name(name: object, what: str) -> str:
    """`name` when it is a plain, visible file name; BadInputError naming `what` otherwise."""
    if not _plain(name):
        raise BadInputError(
            f"{what} {name!r} is not a plain file name (no folders, '..', absolute paths, backslashes or NUL)"
        )
    return name  # type: ignore[return-value]


def check_relative(path: str, what: str) -> str:
    """`path` when it is a relative POSIX path whose every part is a plain file name."""
    if not isinstance(path, str) or not all(_plain(part) for part in path.split("/")):
        raise BadInputError(
            f"{what} {path!r} is not a relative path of plain file names (no '..', absolute paths, "
            "backslashes or NUL)"
        )
    return path


def index_shards(index: Path) -> list[str]:
    """The shard file names a model.safetensors.index.json maps tensors to, each checked by `check_name`."""
    try:
        data = json.loads(index.read_bytes())
    except ValueError as exc:  # includes bad UTF-8
        raise BadInputError(f"source {INDEX} is not valid JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInputError(f"source {INDEX} has no 'weight_map' object (tensor name -> shard file)")
    shards = set()
    for tensor, shard in weight_map.items():
        check_name(shard, f"source {INDEX} shard of tensor {tensor!r}:")
        if not shard.endswith(SHARD_SUFFIX):
            raise BadInputError(f"source {INDEX} shard {shard!r} is not a {SHARD_SUFFIX} file")
        shards.add(shard)
    return sorted(shards)


def file_kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def regular_file(root: Path, rel: str, what: str = "source") -> Path:
    """The resolved path of `root/rel`: inside the resolved `root` and a regular file, checked without
    opening it. `rel` is a relative path checked by `check_relative`."""
    check_relative(rel, what)
    base = root.resolve()
    try:
        resolved = (root / rel).resolve(strict=True)
    except FileNotFoundError:
        broken = os.path.islink(root / rel)
        raise BadInputError(f"{what} {rel} is {'a broken symlink' if broken else 'missing'}") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise BadInputError(f"{what} {rel} cannot be resolved: {exc}") from None
    if not resolved.is_relative_to(base):
        raise BadInputError(
            f"{what} {rel} is a symlink to {resolved}, outside the model folder; copy the file in instead"
        )
    kind = file_kind(os.stat(resolved).st_mode)
    if kind != "file":
        raise BadInputError(f"{what} {rel} is a {kind}, not a regular file")
    return resolved


def regular_files(folder: Path) -> list[tuple[str, Path]]:
    """(relative path, resolved path) of every visible file under `folder`, sorted, each checked by
    `regular_file`. Symlinked folders are not entered (as `Path.rglob`), but one leading out is refused."""
    base = folder.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        top = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in dirnames:
            if (top / name).is_symlink() and not (top / name).resolve().is_relative_to(base):
                rel = (top / name).relative_to(base).as_posix()
                raise BadInputError(f"source {rel} is a symlink to a folder outside the model folder")
        for name in filenames:
            if name.startswith("."):
                continue
            rel = (top / name).relative_to(base).as_posix()
            found.append((rel, regular_file(base, rel)))
    return sorted(found)
