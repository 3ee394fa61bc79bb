"""TensorBoard event files next to metrics.jsonl, written from the same records.

Every scalar comes from a metrics.jsonl record, i.e. from values the run already copied to the host
at a log step: writing them adds no device→host sync. `MetricsLog` owns one `TensorBoardLog`, so the
co-located run and the process layouts (drafter 0 with the aggregated rank telemetry) get the same
tags. Open with `tensorboard --logdir RUN_DIR`.

Tags (x axis = optimizer step of the record):
  train/loss, train/tau_estimate, train/tau_exact, train/tok_per_s, train/lr, train/skipped_steps
  accuracy/pos{k}            accuracy of block position k = 1 … B−1
  tau/measured, tau/tokens_per_s, tau/wall_s   measured τ records (`tau_every`, training/tau_probe.py)
  validation/loss, validation/tau_exact, validation/tau_estimate, validation_accuracy/pos{k}
                             the end-of-run validation at the last step (`write_validation`: its own
                             event file, since validation is no metrics.jsonl record)
  busy_pct/rank{r}_{role}    GPU busy % of rank r over the log interval (CUDA only)
  wait_pct/rank{r}_{role}    % of the interval blocked on the other side
  transfer_ms/rank{r}_{role} ms moving data per micro-batch of the interval
  queue_occupancy/rank{r}_{role}, tok_per_s/rank{r}_{role}, nvml_util_pct/rank{r}_{role}

Resume: the event files always mirror metrics.jsonl. On open, this run's old event files are removed
and the records metrics.jsonl kept (those up to the resumed step) are written again, so the curves
continue from the checkpoint without the steps that were thrown away.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

EVENT_GLOB = "events.out.tfevents.*.dflash"  # only our files are removed on reopen
_TRAIN_KEYS = ("loss", "tau_estimate", "tau_exact", "tok_per_s", "lr", "skipped_steps")
_TAU_TAGS = (("tau_measured", "tau/measured"), ("tau_tokens_per_s", "tau/tokens_per_s"), ("tau_wall_s", "tau/wall_s"))


def record_scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """(tag, value) pairs of one metrics.jsonl record; None values and missing keys are left out."""
    out: list[tuple[str, float]] = []
    for key in _TRAIN_KEYS:
        if record.get(key) is not None:
            out.append((f"train/{key}", float(record[key])))
    for key, tag in _TAU_TAGS:
        if record.get(key) is not None:
            out.append((tag, float(record[key])))
    for k, acc in enumerate(record.get("acc_per_position") or [], start=1):
        if acc is not None:
            out.append((f"accuracy/pos{k}", float(acc)))
    for r in record.get("ranks") or []:
        name = f"rank{r['rank']}_{r['role']}"
        items = r.get("items") or 0
        transfer_ms = (r["transfer_pct"] / 100.0 * r["seconds"] * 1000.0 / items
                       if items > 0 and r.get("transfer_pct") is not None and r.get("seconds") is not None else None)
        for tag, value in (("busy_pct", r.get("busy_pct")), ("wait_pct", r.get("wait_pct")),
                           ("transfer_ms", transfer_ms), ("queue_occupancy", r.get("occupancy_mean")),
                           ("tok_per_s", r.get("tok_per_s")), ("nvml_util_pct", r.get("nvml_util_pct"))):
            if value is not None:
                out.append((f"{tag}/{name}", float(value)))
    return out


def validation_scalars(summary: dict[str, Any]) -> list[tuple[str, float]]:
    """(tag, value) pairs of a validation summary (`training.validate.validate_rows`); None left out."""
    out = [(f"validation/{key}", float(summary[key])) for key in ("loss", "tau_exact", "tau_estimate")
           if summary.get(key) is not None]
    out += [(f"validation_accuracy/pos{k}", float(acc))
            for k, acc in enumerate(summary.get("acc_per_position") or [], start=1) if acc is not None]
    return out


def write_validation(folder: Path, step: int, summary: dict[str, Any]) -> None:
    """Write the end-of-run validation's scalars at `step` into an event file of their own in
    `folder` (removed with the run's other event files when a resumed run reopens its log).
    Raises ImportError without tensorboard."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    values = [Summary.Value(tag=tag, simple_value=v) for tag, v in validation_scalars(summary)]
    if not values:
        return
    writer = EventFileWriter(str(folder), filename_suffix=".dflash")
    writer.add_event(Event(wall_time=time.time(), step=int(step), summary=Summary(value=values)))
    writer.close()


class TensorBoardLog:
    """One event file in `folder`, written through tensorboard's own EventFileWriter and flushed at
    every record (a record comes once per log interval, so the flush is cheap)."""

    def __init__(self, folder: Path, replay: Iterable[dict[str, Any]] = ()) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        folder = Path(folder)
        for old in folder.glob(EVENT_GLOB):
            old.unlink()
        self._writer = EventFileWriter(str(folder), filename_suffix=".dflash")
        for record in replay:
            self._add(record)
        self._writer.flush()

    def write(self, record: dict[str, Any]) -> None:
        self._add(record)
        self._writer.flush()

    def _add(self, record: dict[str, Any]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in record_scalars(record)]
        if values and "step" in record:
            self._writer.add_event(Event(wall_time=time.time(), step=int(record["step"]), summary=Summary(value=values)))

    def close(self) -> None:
        self._writer.close()
