"""Paths as a run's records write them (train_config.json, checkpoint config.json, summary.json,
prepare_report.json, eval JSON): portable across machines and folder moves. Torch-free.

Rules: a path inside the record's folder (the run folder, the prepared folder, the eval JSON's
folder) is written relative to it (`checkpoint-final`, `data`); anything else as the user gave it
on the command line, never resolved. Names of embedded or packaged resources (a target name, a
packaged data file) are the callers' to give (target_model/paths.py, data/sources.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def portable_path(path: str | Path, folder: str | Path | None) -> str:
    """`path` as a record in `folder` writes it: relative to `folder` (POSIX separators, `.` for the
    folder itself) when it lies inside it, else exactly as given. Neither is required to exist."""
    text = str(path)
    if folder is None:
        return text
    here, root = os.path.abspath(os.path.expanduser(text)), os.path.abspath(os.path.expanduser(str(folder)))
    if here != root and not here.startswith(root.rstrip(os.sep) + os.sep):
        return text
    return Path(os.path.relpath(here, root)).as_posix()


def recorded_path(text: str, folder: str | Path | None) -> Path:
    """The path a record in `folder` names by `text` (`portable_path`'s inverse): `folder / text`
    when `text` is relative and that exists, else `text` as written (a user's path, read from the
    current folder)."""
    p = Path(text).expanduser()
    if folder is not None and not p.is_absolute() and (Path(folder) / p).exists():
        return Path(folder) / p
    return p
