"""Paths as a run's records write them (train_config.json, checkpoint config.json, summary.json,
prepare_report.json, eval JSON): portable across machines and folder moves. Torch-free.

Rules: a path inside the record's folder (the run folder, the prepared folder, the eval JSON's
folder) is written relative to it (`checkpoint-final`, `data`); anything else as the user gave it
on the command line, never resolved. Under `dflash-train recipe`, whose stages run with RUN_ROOT_ENV
naming the recipe's run folder, a path inside that folder is written relative to the record's folder
when the record is inside it too (`../data` in RUN/drafter/train_config.json, `../regen.jsonl` in
RUN/data/prepare_report.json): the run folder moves as a whole. Names of embedded or packaged resources
(a target name, a packaged data file) are the callers' to give (target_model/paths.py, data/sources.py).
"""

from __future__ import annotations

import os
from pathlib import Path


RUN_ROOT_ENV = "DFLASH_TRAINER_RUN_ROOT"  # set by the recipe for its stages: the run folder (recipe/child.py)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def portable_path(path: str | Path, folder: str | Path | None, run_root: str | Path | None = None) -> str:
    """`path` as a record in `folder` writes it: relative to `folder` (POSIX separators, `.` for the
    folder itself) when it lies inside it; relative to `folder` too (`../data`) when both lie inside
    `run_root` (default: the RUN_ROOT_ENV variable, the recipe's run folder; unset = no such folder);
    else exactly as given. Neither is required to exist."""
    text = str(path)
    if folder is None:
        return text
    here, where = os.path.abspath(os.path.expanduser(text)), os.path.abspath(os.path.expanduser(str(folder)))
    if not _inside(here, where):
        run_root = run_root if run_root is not None else os.environ.get(RUN_ROOT_ENV) or None
        root = os.path.abspath(os.path.expanduser(str(run_root))) if run_root else None
        if root is None or not (_inside(here, root) and _inside(where, root)):
            return text
    return Path(os.path.relpath(here, where)).as_posix()


def recorded_path(text: str, folder: str | Path | None) -> Path:
    """The path a record in `folder` names by `text` (`portable_path`'s inverse): `folder / text`
    when `text` is relative and that exists, else `text` as written (a user's path, read from the
    current folder)."""
    p = Path(text).expanduser()
    if folder is not None and not p.is_absolute() and (Path(folder) / p).exists():
        return Path(folder) / p
    return p
