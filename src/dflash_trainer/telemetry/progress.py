"""Live progress (rich) and the metrics.jsonl log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class MetricsLog:
    """Append-only JSONL writer: one object per logged step, flushed at once."""

    def __init__(self, path: Path, resume_from_step: int | None = None) -> None:
        self.path = Path(path)
        if resume_from_step is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= resume_from_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self._fh = open(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def make_progress(console: Console) -> Progress:
    """A progress bar showing step, tok/s, loss, τ estimate, elapsed and ETA."""
    return Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[tok_per_s]:>8} tok/s"), TextColumn("loss {task.fields[loss]}"),
        TextColumn("τ≈{task.fields[tau]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, transient=False, refresh_per_second=2,
    )
