"""A training run's time breakdown, once (`profile_at_step: N`, `profile_steps: k`; off by default).

The loop (training/loop.py) calls `before(step)` at the top of every step and `after(done)` with the
new step count after it. At step N the profiler starts (one device sync first, so the window holds
only its own steps); after step N + k − 1 it stops (one sync), and the breakdown of those k steps
(telemetry/breakdown.py: target forward, drafter forward, LM head + loss, backward, optimizer, mask
build, other) is written to OUT/step_breakdown.json and printed. Every other step runs untouched:
the sections are no-ops without a profiler. A log step inside the window adds its host sync to
"other". A run that resumes past N, or ends first, profiles nothing (an open window is closed with
the steps it holds by `close()`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.telemetry.breakdown import breakdown, format_table


class RunProfiler:
    """Profiles optimizer steps [at_step, at_step + num_steps) of a run once (see the module doc).

    out: the run folder (step_breakdown.json); say: where the table goes (e.g. console.print);
    what: one line saying what a step is (layout)."""

    def __init__(self, at_step: int, num_steps: int, out: Path, device: torch.device, say: Callable[[str], None],
                 what: str):
        self.at, self.n, self.out, self.device, self.say, self.what = at_step, num_steps, Path(out), device, say, what
        self._prof: Any = None
        self._t0 = 0.0
        self._events: tuple[Any, Any] | None = None
        self.result: dict[str, Any] | None = None

    def before(self, step: int) -> None:
        """Start the window when `step` (0-based, about to run) is `at_step`."""
        if step != self.at or self._prof is not None or self.result is not None:
            return
        cuda = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize(self.device)  # intentional host sync: once, at the window's start
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.start()
        if cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0 = time.perf_counter()

    def after(self, steps_done: int) -> None:
        """Close the window once `steps_done` (steps finished so far) reaches at_step + num_steps."""
        if self._prof is not None and steps_done >= self.at + self.n:
            self._finish(steps_done - self.at)

    def close(self, steps_done: int) -> None:
        """End of the loop: close a window still open, with the steps it holds (if any)."""
        if self._prof is not None:
            self._finish(steps_done - self.at)

    def _finish(self, steps: int) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # intentional host sync: once, at the window's end
            self._events[1].record()
            torch.cuda.synchronize(self.device)
            window_ms = self._events[0].elapsed_time(self._events[1])
        else:
            window_ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.stop()
        if steps < 1:
            return
        b = breakdown(prof.events(), steps, window_ms, cuda=cuda, what=self.what)
        self.result = {"first_step": self.at, "steps": steps, "breakdown": b}
        (self.out / "step_breakdown.json").write_text(json.dumps(self.result, indent=2) + "\n")
        self.say(format_table(b))
        self.say(f"(steps {self.at}…{self.at + steps - 1}; written to {self.out / 'step_breakdown.json'})")
