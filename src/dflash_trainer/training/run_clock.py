"""The whole run's time and throughput, across resumed segments, in every layout.

A run may be stopped and resumed many times; each process is one segment. The checkpoint's
Progress carries `wall_seconds` (process wall time) and `train_seconds` (the training loop's
alone, what tok/s divides by) of every earlier segment; a `RunClock` adds this segment's to them
at each checkpoint (`stamp`) and at the end (`totals`), so summary.json reports the whole run and
its last segment (`*_this_run`) alike whether the run was co-located or a process layout.
"""

from __future__ import annotations

import time
from typing import Any

from dflash_trainer.training.checkpoint import Progress


class RunClock:
    """This segment's clock over a run's Progress. Built when the segment starts (process wall time
    counts from there); `start_training(prog)` once the resumed Progress is known, right before the
    training loop; `stamp` before each checkpoint; `totals` for the summary."""

    def __init__(self) -> None:
        self.t_start = time.perf_counter()
        self.t_train = self.t_start
        self.wall_base = self.train_base = 0.0
        self.tok_start = self.step_start = 0

    def start_training(self, prog: Progress) -> None:
        """Mark the start of this segment's training loop; `prog` is the run's Progress as resumed
        (its step, tokens and seconds are what earlier segments did)."""
        self.t_train = time.perf_counter()
        self.tok_start, self.step_start = prog.tokens, prog.step
        self.wall_base, self.train_base = prog.wall_seconds, prog.train_seconds

    def stamp(self, prog: Progress, excluded_s: float = 0.0) -> None:
        """Write the whole run's seconds so far into `prog` (before a checkpoint saves it).
        excluded_s: seconds of this segment's loop that were not training (measured τ)."""
        now = time.perf_counter()
        prog.wall_seconds = self.wall_base + now - self.t_start
        prog.train_seconds = self.train_base + now - self.t_train - excluded_s

    def totals(self, prog: Progress, train_wall_s: float) -> dict[str, Any]:
        """The summary's step, token and time fields: the whole run (`steps`, `tokens`, `wall_s`,
        `train_tok_per_s`) and this segment (`steps_this_run`, `wall_s_this_run`,
        `train_tok_per_s_this_run`). train_wall_s: seconds this segment's loop trained (seconds)."""
        wall = time.perf_counter() - self.t_start
        return {"steps": prog.step, "tokens": prog.tokens, "wall_s": self.wall_base + wall,
                "train_tok_per_s": prog.tokens / max(self.train_base + train_wall_s, 1e-9),
                "steps_this_run": prog.step - self.step_start, "wall_s_this_run": wall,
                "train_tok_per_s_this_run": (prog.tokens - self.tok_start) / max(train_wall_s, 1e-9)}
