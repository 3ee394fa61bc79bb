"""The logging rank's metric log, the same in every layout: one metrics.jsonl record (and the same
TensorBoard scalars) per log interval, and a live view of it.

Record fields: step, epoch, loss, tokens (target tokens so far), tok_per_s (target tokens per second
over the interval), acc_per_position [B−1], tau_estimate, tau_exact, lr, skipped_steps (so far),
elapsed_s; in the process layout also `ranks` (per-rank telemetry, telemetry/rank_rates.py).
Measured-τ records (co-located runs with `tau_every`, training/tau_probe.py) are records of their
own: step, tau_measured, tau_measured_uncapped, tau_prompts, tau_tokens, tau_rounds, tau_tokens_per_s,
tau_wall_s. The time a measurement takes is left out of the next interval's tok_per_s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from dflash_trainer.telemetry.progress import MetricsLog
from dflash_trainer.telemetry.rank_rates import format_line
from dflash_trainer.training.checkpoint import Progress
from dflash_trainer.training.schedule import RowSchedule


class RunLog:
    """metrics.jsonl (continuing after `prog.step` on resume) plus the live view: `bar` (a
    telemetry.progress bar and its task: co-located) or, with `ranks` (a callable returning the
    per-rank rate rows), one console line per interval (process layout)."""

    def __init__(self, out: Path, prog: Progress, schedule: RowSchedule, total: int, console: Console, *,
                 ranks: Callable[[], list[dict]] | None = None, bar: Any = None, task: Any = None):
        self.log = MetricsLog(Path(out) / "metrics.jsonl", resume_from_step=prog.step)
        self.schedule, self.total, self.console, self.ranks = schedule, total, console, ranks
        self.bar, self.task = bar, task
        self.t_start = time.perf_counter()
        self.t_log, self.tok_log = self.t_start, prog.tokens

    def write(self, prog: Progress, summary: dict[str, Any], lr: float, final: bool = False) -> None:
        """One record for the interval that ends at `prog.step` (`summary`: MetricAccumulator.summary)."""
        now = time.perf_counter()
        rate = (prog.tokens - self.tok_log) / max(now - self.t_log, 1e-9)
        self.t_log, self.tok_log = now, prog.tokens
        batch = max(prog.step - 1, 0) // self.schedule.anchor_draws
        record = {"step": prog.step, "epoch": self.schedule.epoch_of(batch), "loss": summary["loss"],
                  "tokens": prog.tokens, "tok_per_s": rate, "acc_per_position": summary["acc_per_position"],
                  "tau_estimate": summary["tau_estimate"], "tau_exact": summary["tau_exact"], "lr": lr,
                  "skipped_steps": prog.skipped_steps, "elapsed_s": now - self.t_start}
        loss = "-" if summary["loss"] is None else f"{summary['loss']:.3f}"
        if self.ranks is not None:
            record["ranks"] = self.ranks()
            self.console.print(f"step {prog.step}/{self.total} loss {loss} {rate:,.0f} tok/s | "
                               f"{format_line(record['ranks'])}", highlight=False)
        self.log.write(record)
        if self.bar is not None:
            tau = "-" if summary["tau_estimate"] is None else f"{summary['tau_estimate']:.2f}"
            self.bar.update(self.task, completed=prog.step, tok_per_s=f"{rate:,.0f}", loss=loss, tau=tau)

    def write_tau(self, m: Any) -> None:
        """The record of one τ measurement (`TauMeasurement`), a console line, and the measurement's
        wall time taken out of the current interval's rate."""
        self.log.write(m.record())
        self.t_log += m.wall_s
        tau = "-" if m.tau is None else f"{m.tau:.3f}"
        self.console.print(f"step {m.step}: measured τ {tau} (greedy speculative decoding of {m.prompts} prompts, "
                           f"{m.tokens:,} tokens in {m.wall_s:.1f} s)", highlight=False)

    def close(self) -> None:
        self.log.close()
