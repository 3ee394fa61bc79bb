"""What a run reports when it ends (`RunResult`, `summary.json`), and the one rule that says a
re-run of a finished command has nothing to do — for the co-located and the multi-process layout.

Both layouts write OUT/summary.json at the end (co-located: `RunResult.as_dict()`; process layout:
drafter 0's summary with `stopped_early` and per-rank fields), OUT/train_config.json (the resolved
config the run trained with) and OUT/checkpoint-final/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dflash_trainer.config.schema import (FORMAT_VERSION, TrainConfig, flat_config, portable_saved, resolve_key,
                                          resolved_paths, saved_config)
from dflash_trainer.files.portable import portable_path, recorded_path
from dflash_trainer.interop.formats import is_checkpoint
from dflash_trainer.training.checkpoint import load_latest

STOP_REQUEST = "a stop request (SIGTERM/SIGINT)"  # RunResult.interrupted of a stopped process layout


@dataclass
class RunResult:
    """What a finished run reports (also printed as the summary). In every layout steps, tokens,
    wall_s and train_tok_per_s cover the whole run, every resumed segment included, and the
    `*_this_run` fields the last process alone (training/run_clock.py). tau_measured / tau_measured_step: the last measured τ of a co-located run with
    `tau_every` and its step (None otherwise)."""

    steps: int
    tokens: int
    wall_s: float
    train_tok_per_s: float
    first_loss: float | None
    last_loss: float | None
    validation: dict[str, Any]
    checkpoint: str | None
    skipped_steps: int = 0
    interrupted: str | None = None
    tau_measured: float | None = None
    tau_measured_step: int | None = None
    feature_cache: dict[str, Any] | None = None  # FeatureCache.summary() when feature_cache_gib > 0
    peak_memory_gib: dict[str, float] | None = None  # `peak_memory` on CUDA: what the run held at most
    steps_this_run: int | None = None
    wall_s_this_run: float | None = None
    train_tok_per_s_this_run: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def record(self, out: str | Path) -> dict[str, Any]:
        """summary.json's body in run folder `out`: `as_dict` with the checkpoint relative to `out`
        (`checkpoint-final`), so the record stays true when the folder moves (`read_result` reads it back)."""
        return {**self.as_dict(), "checkpoint": portable_path(self.checkpoint, out) if self.checkpoint else None}


def peak_memory(device: Any) -> dict[str, float] | None:
    """GiB the run's CUDA device held at most (`allocated`: tensors; `reserved`: the caching allocator's
    segments, what an out-of-memory error compares with `total`), from torch's counters since the
    process started; None off CUDA."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    gib = 2.0 ** 30
    return {"allocated": round(torch.cuda.max_memory_allocated(device) / gib, 2),
            "reserved": round(torch.cuda.max_memory_reserved(device) / gib, 2),
            "total": round(torch.cuda.get_device_properties(device).total_memory / gib, 2)}


def result_from_summary(body: dict[str, Any]) -> RunResult:
    """The RunResult of a summary.json of either layout (extra fields ignored; a process layout's
    `stopped_early` becomes `interrupted`). Raises TypeError when a field RunResult needs is
    missing (a summary of another version)."""
    values = {f.name: body[f.name] for f in fields(RunResult) if f.name in body}
    if "stopped_early" in body:
        values["interrupted"] = STOP_REQUEST if body["stopped_early"] else None
    return RunResult(**values)


def read_result(out: str | Path) -> RunResult:
    """The RunResult of OUT/summary.json (`result_from_summary`), its checkpoint a path from here
    (OUT/checkpoint-final; the file holds it relative to OUT). Raises OSError / ValueError for a
    missing or unreadable file, TypeError for a summary of another version."""
    result = result_from_summary(json.loads((Path(out) / "summary.json").read_text()))
    if result.checkpoint:
        result.checkpoint = str(Path(out) / result.checkpoint)  # an absolute one (older runs) stays as it is
    return result


def finished_run(cfg: TrainConfig) -> RunResult | None:
    """The summary of OUT when this exact run already finished, else None.

    Finished means: resume=auto; summary.json of an uninterrupted run; a readable checkpoint-final
    as the newest checkpoint; train_config.json equal to `cfg` but for `out` and `resume` (fields
    it lacks are not compared); and, when max_steps is set, the summary's step count equal to it
    (a larger max_steps continues).
    `cfg` must be the config as the run records it (the process layout passes its rounded
    rows_per_step and its prepared folder). A re-run of a finished command then does nothing and
    overwrites none of its records.
    """
    out = Path(cfg.out)
    if cfg.runtime.resume != "auto" or not is_checkpoint(out / "checkpoint-final", resumable=True):
        return None
    try:
        result = read_result(out)
        saved = json.loads((out / "train_config.json").read_text())
        current = flat_config(json.loads(json.dumps(saved_config(cfg))))
    except (OSError, ValueError, TypeError):  # missing, half-written or of another version: train
        return None
    if not isinstance(saved, dict) or saved.get("format_version") != FORMAT_VERSION:
        return None  # a flat config of an earlier release: not this run's (resuming it is refused)
    # a record of older code holds its paths as given; a path spelled another way (`../data` inside a recipe,
    # RUN/data by hand) is the same path
    saved, current = resolved_paths(flat_config(portable_saved(saved)), out), resolved_paths(current, out)
    # fields only one side knows (another version of the tool) are not compared, as on resume
    same = all(saved[k] == v for k, v in current.items() if k in saved and k not in ("out", "runtime.resume"))
    if not same or result.interrupted is not None:
        return None
    if cfg.optim.max_steps is not None and result.steps != cfg.optim.max_steps:
        return None
    newest = load_latest(out, lambda _msg: None)  # checkpoint-final must also be readable
    if newest is None or newest[0].name != "checkpoint-final":
        return None
    return result


def finished_with_recorded_split(cfg: TrainConfig) -> RunResult | None:
    """`finished_run` for a `--gpus/--procs` command, before anything is measured or prepared:
    `cfg` with the layout the run recorded in OUT/train_config.json (the split it chose, its rounded
    default rows_per_step, OUT/data when no `prepared` was given). None when not finished."""
    try:
        saved = json.loads((Path(cfg.out) / "train_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("format_version") != FORMAT_VERSION:
        return None
    saved = flat_config(portable_saved(saved))  # an older record's paths as today's (config/schema.py)
    keys = ["gpus", "procs", "target_gpus", "drafter_gpus", "target_procs", "drafter_procs"]
    keys += [] if "rows_per_step" in cfg.optim.model_fields_set else ["rows_per_step"]
    keys += [] if cfg.data.prepared else ["prepared"]
    values = {k: saved[name] for k in keys if (name := resolve_key(k) or k) in saved}
    if values.get("prepared") is not None:  # saved relative to OUT when inside it (files/portable.py)
        values["prepared"] = str(recorded_path(values["prepared"], cfg.out))
    return finished_run(cfg.updated(values))


def finished_message(cfg: TrainConfig, done: RunResult) -> str:
    """The line a re-run of a finished command prints."""
    return (f"{cfg.out} already finished at step {done.steps} (summary.json, checkpoint-final); nothing to do. "
            "Delete the folder or pass --resume never to train again.")


def print_summary(result: RunResult, console: Any) -> None:
    """The end-of-run summary a person reads: steps, tokens, tok/s, wall, first and last train loss,
    validation (loss, τ, accuracy per position, the rows it covered), skipped steps, checkpoint."""
    v = result.validation
    console.print("\n[bold]summary[/]")
    console.print(f"  steps {result.steps}, {result.tokens:,} context tokens, {result.train_tok_per_s:,.0f} tok/s, wall {result.wall_s:.0f} s")
    if result.wall_s_this_run is not None and result.steps_this_run is not None and result.steps_this_run != result.steps:
        console.print(f"  this run (resumed at step {result.steps - result.steps_this_run}): {result.steps_this_run} "
                      f"steps, {result.train_tok_per_s_this_run or 0:,.0f} tok/s, wall {result.wall_s_this_run or 0:.0f} s")
    if result.first_loss is not None:
        console.print(f"  train loss {result.first_loss:.3f} (first log) → {result.last_loss:.3f} (last log)")
    if v:
        from dflash_trainer.training.validate import coverage

        def num(x: float | None, digits: int) -> str:
            return "-" if x is None else f"{x:.{digits}f}"

        acc = ", ".join(num(a, 2) for a in v["acc_per_position"])
        rows = f" on {coverage(v)}" if coverage(v) else ""
        console.print(f"  validation loss {num(v['loss'], 3)}, τ exact {num(v['tau_exact'], 2)}, "
                      f"τ estimate {num(v['tau_estimate'], 2)}{rows}", highlight=False)
        console.print(f"  validation acc per position: [{acc}]")
    if result.tau_measured is not None:
        console.print(f"  measured τ {result.tau_measured:.3f} at step {result.tau_measured_step} "
                      "(greedy speculative decoding, metrics.jsonl tau_measured)", highlight=False)
    if result.skipped_steps:
        console.print(f"  [yellow]{result.skipped_steps} steps skipped (non-finite loss or gradients)[/]")
    console.print(f"  checkpoint {result.checkpoint}")
    if result.checkpoint:
        out = Path(result.checkpoint).parent
        if (out / "report.png").is_file():
            console.print(f"  report {out / 'report.png'} (curves; `tensorboard --logdir {out}` for more)", highlight=False)
