"""`dflash-train report RUN_DIR`: one PNG that shows how a run went.

Reads RUN_DIR/metrics.jsonl (a running run's too: a half-written last line is skipped) and, when
present, RUN_DIR/summary.json (validation at the end of the run). Panels:
  loss          training loss per log interval; the validation loss as a point at the last step
  accuracy      per-position accuracy of the last log interval (and of validation when present)
  τ             offline τ (product estimate and exact run length) per log interval, and the
                measured τ (real speculative decoding, `tau_every`) at the steps it was measured
  tok/s         context tokens per second per log interval
  busy timeline process layouts only: each rank's GPU busy % per log interval (rows = ranks,
                columns = log intervals; grey = not measured, e.g. CPU ranks)

matplotlib through its Agg canvas directly (no pyplot, no global backend switch), imported lazily so
the CLI and the training loop do not pay for it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_trainer.telemetry.progress import read_records

REPORT_NAME = "report.png"


def load_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(metrics records, summary) of a run folder; summary is {} while the run is still going.
    Raises FileNotFoundError without metrics.jsonl and ValueError when it holds no record yet."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found: give a run directory (the `out` of `dflash-train train`)")
    records = read_records(metrics)
    if not records:
        raise ValueError(f"{metrics} holds no complete record yet; try again after the first log step")
    summary: dict[str, Any] = {}
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        pass  # running, or stopped before the end
    return records, summary


def write_report(run_dir: str | Path, path: str | Path | None = None) -> Path:
    """Plot the run in `run_dir` into one PNG (default RUN_DIR/report.png, written by `save_png`)
    and return its path. Raises FileNotFoundError / ValueError as `load_run` does."""
    from matplotlib.ticker import MaxNLocator

    run = Path(run_dir)
    records, summary = load_run(run)
    validation = summary.get("validation") or {}
    has_ranks = any(r.get("ranks") for r in records)
    fig = new_figure((15, 8.5) if has_ranks else (11, 8), layout="constrained")
    grid = fig.add_gridspec(2, 3) if has_ranks else fig.add_gridspec(2, 2)
    _loss_panel(fig.add_subplot(grid[0, 0]), records, validation)
    _accuracy_panel(fig.add_subplot(grid[0, 1]), records, validation)
    _tau_panel(fig.add_subplot(grid[1, 0]), records)
    _rate_panel(fig.add_subplot(grid[1, 1]), records)
    if has_ranks:
        _busy_panel(fig, fig.add_subplot(grid[:, 2]), records)
    for ax in fig.axes:
        if ax.get_xlabel() == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    finished = bool(summary) and summary.get("interrupted") is None and summary.get("steps") == records[-1]["step"]
    state = "finished" if finished else ("stopped" if summary and summary.get("interrupted") else
                                         "running (partial metrics.jsonl)")
    fig.suptitle(f"{run.resolve().name}: step {records[-1]['step']}, {state}")
    return save_png(fig, path if path is not None else run / REPORT_NAME)


def new_figure(figsize: tuple[float, float], **kwargs: Any) -> Any:
    """A matplotlib Figure (size in inches) on the Agg canvas: no pyplot, no global backend switch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Any, path: str | Path) -> Path:
    """Write `fig` at 100 dpi to `path` (parent folders created) in the format its suffix names
    (.png, .svg, .pdf, …; PNG without a suffix) through a temporary name and a rename, so a viewer
    never sees half a file; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, dpi=100, format=out.suffix[1:].lower() or "png")
    os.replace(tmp, out)
    return out


def write_report_safely(run_dir: str | Path, warn: Callable[[str], None]) -> Path | None:
    """`write_report` at the end of a run: any failure is reported through `warn`, never raised
    (a plot must not fail a run that trained)."""
    try:
        return write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, the run itself succeeded
        warn(f"{REPORT_NAME} not written ({type(e).__name__}: {str(e)[:200]}); "
             f"retry with `dflash-train report {run_dir}`")
        return None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where `key` is a finite number."""
    pts = [(r["step"], float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def _loss_panel(ax, records, validation) -> None:
    steps, loss = _series(records, "loss")
    ax.plot(steps, loss, label="train", lw=1.2)
    if validation.get("loss") is not None:
        ax.plot([records[-1]["step"]], [validation["loss"]], "o", color="C3", label=f"validation {validation['loss']:.3f}")
    ax.set_title("loss")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()


def _accuracy_panel(ax, records, validation) -> None:
    last = next((r for r in reversed(records) if r.get("acc_per_position")), None)
    series = [(f"train (step {last['step']})", last["acc_per_position"])] if last else []
    if validation.get("acc_per_position"):
        series.append(("validation", validation["acc_per_position"]))
    width = 0.8 / max(len(series), 1)
    for i, (label, acc) in enumerate(series):
        ks = [k for k, a in enumerate(acc, start=1) if a is not None]
        ax.bar([k + (i - (len(series) - 1) / 2) * width for k in ks], [acc[k - 1] for k in ks], width=width, label=label)
    ax.set_title("accuracy per block position (end)")
    ax.set_xlabel("position k in the block")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3, axis="y")
    if series:
        ax.set_xticks(range(1, len(series[0][1]) + 1))
        ax.legend()


def _tau_panel(ax, records) -> None:
    for key, label in (("tau_estimate", "τ estimate (Π accuracy)"), ("tau_exact", "τ exact (run length)")):
        steps, tau = _series(records, key)
        if steps:
            ax.plot(steps, tau, label=label, lw=1.2)
    steps, tau = _series(records, "tau_measured")
    if steps:
        n = next(r.get("tau_prompts") for r in reversed(records) if r.get("tau_measured") is not None)
        ax.plot(steps, tau, "o-", color="C3", lw=1.2, ms=4, label=f"τ measured (speculative decoding, {n} prompts)")
    ax.set_title("τ (tokens per draft round)" if steps else "offline τ (tokens per draft round)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()


def _rate_panel(ax, records) -> None:
    steps, rate = _series(records, "tok_per_s")
    ax.plot(steps, rate, lw=1.2)
    ax.set_title("throughput (tok/s per log interval)")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _busy_panel(fig, ax, records) -> None:
    """Heat map rows = ranks, columns = log intervals (step edges), colour = busy %."""
    import matplotlib
    import numpy as np

    ranked = [r for r in records if r.get("ranks")]
    names: dict[int, str] = {}
    for rec in ranked:
        for r in rec["ranks"]:
            names.setdefault(r["rank"], f"rank {r['rank']} {r['role']} {r.get('device', '')}".strip())
    order = sorted(names)
    steps = [rec["step"] for rec in ranked]
    first = steps[0] - (steps[1] - steps[0]) if len(steps) > 1 else 0  # a resumed run starts past 0
    edges = [max(first, 0)] + steps
    busy = np.full((len(order), len(ranked)), np.nan)
    for j, rec in enumerate(ranked):
        for r in rec["ranks"]:
            if r.get("busy_pct") is not None:
                busy[order.index(r["rank"]), j] = r["busy_pct"]
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d0d0d0")  # grey: not measured
    mesh = ax.pcolormesh(edges, np.arange(len(order) + 1), np.ma.masked_invalid(busy), cmap=cmap, vmin=0, vmax=100)
    ax.set_yticks(np.arange(len(order)) + 0.5, [names[k] for k in order])
    ax.invert_yaxis()
    ax.set_xlabel("step")
    measured = np.isfinite(busy).any()
    ax.set_title("GPU busy % per log interval" + ("" if measured else "\n(not measured: CPU ranks)"))
    fig.colorbar(mesh, ax=ax, label="busy %", location="bottom", shrink=0.8)
