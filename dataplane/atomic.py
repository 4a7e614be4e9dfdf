"""Publishing a folder atomically: readers see the old folder or the complete new one, never a half."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_folder(staging: Path, out: Path) -> None:
    """Put the complete `staging` folder (a sibling of `out`) in place of `out` with renames."""
    if out.is_dir():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(out)
