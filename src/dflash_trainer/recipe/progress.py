"""The recipe's progress: one rich bar over all stages with the whole recipe's ETA (the plan's estimates
of the stages left, scaled by how the finished stages compared with theirs); plain lines when the
console is not a terminal."""

from __future__ import annotations

import time
from typing import Optional

from rich.console import Console


class RecipeProgress:
    """Progress over `estimates` (stage → estimated s). Call begin/tick/end per stage, skip for a skipped one."""

    def __init__(self, console: Console, estimates: dict[str, float]):
        self.console, self.est = console, dict(estimates)
        self.done_est = self.done_real = 0.0
        self.current: Optional[str] = None
        self.t0 = time.monotonic()
        self.bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[eta]}"),
                                console=console, transient=False)
            self.task = self.bar.add_task("recipe", total=sum(self.est.values()) or 1, eta="")
            self.bar.start()

    def eta(self) -> float:
        """Seconds left: the estimates of the unfinished stages × (real / estimated) of the finished ones, that
        ratio held to [0.5, 2] (one stage's pace says little of another's: a fast CPU mixture stage once scaled a
        GPU regeneration's estimate to a third)."""
        left = sum(self.est.values()) - self.done_est
        scale = min(2.0, max(0.5, self.done_real / self.done_est)) if self.done_est > 30 else 1.0
        elapsed = time.monotonic() - self.t0 if self.current else 0.0
        return max(0.0, left * scale - elapsed)

    def _update(self) -> None:
        if self.bar:
            elapsed = time.monotonic() - self.t0 if self.current else 0.0
            now = self.done_est + min(elapsed, 0.95 * self.est.get(self.current or "", 0.0))
            self.bar.update(self.task, completed=now, description=f"recipe: {self.current or 'done'}",
                            eta=f"ETA {self.eta() / 60:.1f} min")

    def skip(self, stage: str, why: str) -> None:
        self.est.pop(stage, None)
        self.console.print(f"[recipe] {stage}: {why}", highlight=False, markup=False)
        if self.bar:
            self.bar.update(self.task, total=sum(self.est.values()) or 1)

    def begin(self, stage: str, what: str) -> None:
        self.current, self.t0 = stage, time.monotonic()
        self.console.print(f"[recipe] {stage}: {what} (ETA of the recipe {self.eta() / 60:.1f} min)", highlight=False, markup=False)
        self._update()

    def tick(self) -> None:
        self._update()

    def end(self, stage: str, seconds: float) -> None:
        self.done_est += self.est.get(stage, 0.0)
        self.done_real += seconds
        self.current = None
        self.console.print(f"[recipe] {stage}: done in {seconds:.0f} s", highlight=False, markup=False)
        self._update()

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
