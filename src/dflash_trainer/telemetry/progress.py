"""Live progress (a rich bar on a terminal, plain lines otherwise) and the metrics.jsonl log."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class MetricsLog:
    """Append-only JSONL writer: one object per logged step, flushed at once. The same records go to
    TensorBoard event files in the same folder (telemetry/tensorboard_log.py; `tensorboard=False`
    or tensorboard not installed: JSONL only).

    resume_from_step: records after this step are dropped (a resumed run continues from its
    checkpoint's step); a half-written line (a run killed mid-write) is dropped too.
    """

    def __init__(self, path: Path, resume_from_step: int | None = None, tensorboard: bool = True) -> None:
        self.path = Path(path)
        kept: list[dict[str, Any]] = []
        if self.path.exists():
            lines = [(ln, parse_record(ln)) for ln in self.path.read_text().splitlines()]
            pairs = [(ln, rec) for ln, rec in lines if rec is not None]
            if resume_from_step is not None:
                pairs = [(ln, rec) for ln, rec in pairs if rec.get("step", 0) <= resume_from_step]
            if len(pairs) != len(lines):
                self.path.write_text("".join(ln + "\n" for ln, _ in pairs))
            kept = [rec for _, rec in pairs]
        self._fh = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from dflash_trainer.telemetry.tensorboard_log import TensorBoardLog

                self._tb = TensorBoardLog(self.path.parent, replay=kept)
            except ImportError as e:
                warnings.warn(f"no TensorBoard event files ({e}); pip install tensorboard", stacklevel=2)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            self._tb.write(record)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def parse_record(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line as a dict; None for a blank or half-written line."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, finished or still being written (bad lines skipped)."""
    return [rec for ln in Path(path).read_text().splitlines() if (rec := parse_record(ln)) is not None]


class PlainProgress:
    """Progress as plain lines, for output that is not a terminal (`| tee`, a log file, a job
    scheduler), where the rich bar draws nothing until the end. The same calls as rich's Progress
    (add_task, update, context manager); a line is printed once per metric update (every
    `log_every` steps), when the step count that goes with it arrives. `label` and `unit` name
    the phase and what it counts (training steps; validation rows):

        train step 40/160 (25%) loss 5.123 τ≈1.84 2,345 tok/s elapsed 0:01:02 ETA 0:03:05
        validate row 8/16 (50%) loss 7.410 τ≈1.07 1,620 tok/s elapsed 0:00:19 ETA 0:00:19
    """

    def __init__(self, console: Console, label: str = "train", unit: str = "step") -> None:
        self.console = console
        self.label, self.unit = label, unit
        self.total = self.completed = self.start_step = 0
        self.fields: dict[str, Any] = {}
        self.pending = False
        self.t0 = time.perf_counter()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pending:
            self._line()

    def add_task(self, description: str, *, total: int, completed: int = 0, **fields: Any) -> int:
        self.total, self.completed, self.start_step, self.fields = total, completed, completed, dict(fields)
        self.t0 = time.perf_counter()
        return 0

    def update(self, task: int, *, completed: int | None = None, total: int | None = None, **fields: Any) -> None:
        if total is not None:
            self.total = total
        if fields:
            self.fields.update(fields)
            self.pending = True
        if completed is not None:
            self.completed = completed
            if self.pending:
                self._line()

    def _line(self) -> None:
        self.pending = False
        elapsed = time.perf_counter() - self.t0
        done = self.completed - self.start_step
        eta = _clock(elapsed / done * (self.total - self.completed)) if done > 0 else "-"
        f = self.fields
        pct = 100 * self.completed / max(self.total, 1)
        self.console.print(f"{self.label} {self.unit} {self.completed}/{self.total} ({pct:.0f}%) "
                           f"loss {f.get('loss', '-')} τ≈{f.get('tau', '-')} {f.get('tok_per_s', '-')} tok/s "
                           f"elapsed {_clock(elapsed)} ETA {eta}", markup=False, highlight=False)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def make_progress(console: Console, label: str = "train", unit: str = "step") -> Progress | PlainProgress:
    """Count (training steps, validation rows), tok/s, loss, τ, elapsed and ETA: a rich bar on a
    terminal (or notebook), plain periodic lines otherwise (PlainProgress). The task takes the
    fields tok_per_s, loss and tau (strings)."""
    if not (console.is_terminal or console.is_jupyter):
        return PlainProgress(console, label, unit)
    return Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[tok_per_s]:>8} tok/s"), TextColumn("loss {task.fields[loss]}"),
        TextColumn("τ≈{task.fields[tau]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, transient=False, refresh_per_second=2,
    )
