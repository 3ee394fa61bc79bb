"""A refused start leaves no run folder behind.

`train` creates OUT (and any missing parents) and writes its setup records (train_config.json,
provenance.json, the rows it prepares into OUT/data, the launcher's layout files) before the
target loads. A start that fails after that (a target that does not load, a mask token that the
data uses, a rank that dies while loading) would leave a folder that looks like a run, and whose
OUT/data a later run could pick up. `removed_if_start_fails(out)` wraps the run: when the run
raises, OUT did not exist before, and OUT holds nothing but setup records (no checkpoint, no
metrics.jsonl, no summary.json), the folders this invocation created are removed. A folder that
existed before is never touched. Torch-free.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SETUP_RECORDS = frozenset({"train_config.json", "provenance.json", "data", "auto_split.json", "layout.json",
                           "ranks.json", "exit_status.json"})


def first_created(out: str | Path) -> Path | None:
    """The outermost folder that creating `out` makes: `out` itself or its highest missing
    ancestor; None when `out` exists already."""
    p = Path(out).expanduser().absolute()
    if p.exists():
        return None
    top = p
    for parent in p.parents:
        if parent.exists():
            break
        top = parent
    return top


def remove_failed_start(created: Path, out: str | Path) -> bool:
    """Remove `created` (`first_created(out)` before the run) when every folder from it down to
    OUT holds only the next one and OUT holds only SETUP_RECORDS; returns whether it removed."""
    out = Path(out).expanduser().absolute()
    if not created.is_dir():
        return False
    chain = [a for a in reversed(out.parents) if a.is_relative_to(created)] + [out]  # created … OUT
    for folder, child in zip(chain, chain[1:]):
        if not folder.is_dir() or {c.name for c in folder.iterdir()} - {child.name}:
            return False  # something else appeared beside the path to OUT: not ours alone
    if out.is_dir() and {c.name for c in out.iterdir()} - SETUP_RECORDS:
        return False  # a checkpoint, metrics or anything else: keep it
    shutil.rmtree(created, ignore_errors=True)
    return True


@contextmanager
def removed_if_start_fails(out: str | Path, *, enabled: bool = True) -> Iterator[None]:
    """Run the body; when it raises (any exception, a Ctrl-C or the CLI's exit included), remove the
    folders it created for OUT if they hold nothing but setup records (`remove_failed_start`).
    enabled=False (e.g. a torchrun rank, whose peers may still write) only runs the body."""
    created = first_created(out) if enabled else None
    try:
        yield
    except BaseException:
        if created is not None:
            remove_failed_start(created, out)
        raise
