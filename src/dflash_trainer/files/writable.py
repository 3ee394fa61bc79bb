"""Whether a path a command will write can be created: no ancestor of it is a file and the nearest
existing folder is writable; a file path is no folder. File-system tests only, before anything is
created or loaded. What an existing path is, and whether an output folder may be written over
(`check_new_folder`, `check_run_out`), is preflight/paths.py's, which builds on these."""

from __future__ import annotations

import os
from pathlib import Path


def file_ancestor(path: str | Path) -> Path | None:
    """The nearest ancestor of `path` that exists and is not a folder (None when there is none)."""
    for parent in Path(path).expanduser().parents:  # relative paths stop at ".", which exists
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_creatable(value: str, flag: str) -> None:
    """Raise when `value` cannot be created: an ancestor is a file, or the nearest existing folder
    is not writable."""
    p = Path(value).expanduser()
    blocker = file_ancestor(p)
    if blocker is not None:
        raise ValueError(f"{flag} {value}: {blocker} is a file, not a folder; choose a path under a folder")
    folder = p if p.is_dir() else next(a for a in p.absolute().parents if a.exists())
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {value}: {folder} is not writable; choose a folder you can write")


def check_new_file(value: str | None, flag: str) -> None:
    """Raise unless `value` (when set) is a file path that can be written (an existing file is replaced)."""
    if value is None:
        return
    check_creatable(value, flag)
    if Path(value).expanduser().is_dir():
        raise ValueError(f"{flag} {value} is a folder, not a file: give a file path")
