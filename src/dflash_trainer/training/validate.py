"""Validation at the end of a run: held-out rows through the frozen target and the drafter, with
live progress and a budget (`validation_max_rows`, `validation_max_seconds`).

Rows are taken one at a time in the (seed, epoch 0) order of the validation split, so a row
budget always picks the same rows. The result says how many rows it covered out of how many and
which budget cut it short; a cut is never silent.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from rich.console import Console

from dflash_trainer.data.loader import iterate_rows
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.telemetry.progress import make_progress
from dflash_trainer.training import precision
from dflash_trainer.training.feed import extract, rows_to
from dflash_trainer.training.step import StepSettings, drafter_step

MAX_ROWS, MAX_SECONDS = "validation_max_rows", "validation_max_seconds"  # the config fields of the budget


@torch.no_grad()
def validate_rows(drafter: DFlashDrafter, extractor: TargetFeatureExtractor, rows_ds: Any, settings: StepSettings,
                  device: torch.device, seed: int, console: Console, *, max_rows: int | None = None,
                  max_seconds: float | None = None) -> dict[str, Any]:
    """Loss, per-position accuracy and offline τ (exact and product estimate) on held-out rows.

    rows_ds: the validation split (rows of T tokens). max_rows: validate at most this many rows
    (None = all). max_seconds: start no new row after this many seconds, counted from the end of
    the first row (None = no limit; at least one row is always validated, and its one-off costs,
    e.g. compiling the target layers for a batch of one row, do not count against the budget). Progress goes
    to `console`: a rich bar on a terminal, one plain line per ~10 % of the rows otherwise.

    Returns `MetricAccumulator.summary()` (loss, acc_per_position, tau_exact, tau_estimate, ...)
    plus rows_validated, rows_total, cut_by (None, "validation_max_rows" or
    "validation_max_seconds") and seconds (wall time). Returns {} for an empty split.
    """
    rows_total = len(rows_ds)
    if rows_total == 0:
        return {}
    planned = rows_total if max_rows is None else min(rows_total, max_rows)
    every = max(1, math.ceil(planned / 10))  # plain progress lines: about ten
    was_training = drafter.training
    drafter.eval()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    acc = MetricAccumulator(drafter.config.block_size, device)
    autocast = precision.autocast(device)
    running = [0.0, 0.0, 0.0, 0.0]  # loss_sum, weight_sum, run_length_sum, num_blocks (host copies, for progress)
    done, tokens, cut_by = 0, 0, None
    t0 = budget_t0 = time.perf_counter()
    with make_progress(console, "validate", "row") as progress:
        task = progress.add_task("validate", total=planned, completed=0, tok_per_s="-", loss="-", tau="-")
        for batch in iterate_rows(rows_ds, 1, seed, 0):
            if done == planned:
                break
            rows = rows_to(batch, device)
            tgt = extract(extractor, rows, settings)
            with autocast:
                sums = drafter_step(drafter, rows, tgt.features, tgt.argmax, settings, gen, tgt.last_hidden)
            acc.add(sums)
            done += 1
            tokens += rows["input_ids"].numel()
            # host sync: one copy of four scalars per validated row (progress and the time budget)
            row = torch.stack([sums.loss_sum.double(), sums.weight_sum.double(), sums.run_length_sum.double(),
                               sums.num_blocks.double()]).tolist()
            running = [a + b for a, b in zip(running, row)]
            now = time.perf_counter()
            elapsed = now - t0
            if done == 1:
                budget_t0 = now
            out_of_time = max_seconds is not None and now - budget_t0 >= max_seconds and done < planned
            if max_seconds is not None and done >= 2 and not out_of_time:
                # rows the time budget will let start, at the pace so far: the progress total, so its ETA
                # (and the bar) end with the budget rather than after every planned row
                pace = (now - budget_t0) / (done - 1)
                progress.update(task, total=min(planned, done + math.ceil((max_seconds - (now - budget_t0)) / pace)))
            if done % every == 0 or done == planned or out_of_time:
                progress.update(task, tok_per_s=f"{tokens / max(elapsed, 1e-9):,.0f}",
                                loss=_ratio(running[0], running[1], 3), tau=_ratio(running[2], running[3], 2, plus=1.0))
            progress.update(task, completed=done)
            if out_of_time:
                cut_by = MAX_SECONDS
                break
    if cut_by is None and done < rows_total:
        cut_by = MAX_ROWS
    drafter.train(was_training)
    summary = acc.summary()
    summary.update(rows_validated=done, rows_total=rows_total, cut_by=cut_by, seconds=time.perf_counter() - t0)
    return summary


def coverage(validation: dict[str, Any]) -> str:
    """'all 37 rows' or '16 of 37 rows (validation_max_rows reached)' for a `validate_rows` result;
    '' for a result without row counts (summaries written before the budget existed)."""
    done, total = validation.get("rows_validated"), validation.get("rows_total")
    if done is None or total is None:
        return ""
    if validation.get("cut_by") is None:
        return f"all {total} rows"
    return f"{done} of {total} rows ({validation['cut_by']} reached)"


def _ratio(num: float, den: float, digits: int, plus: float = 0.0) -> str:
    return "-" if den <= 0 else f"{plus + num / den:.{digits}f}"
