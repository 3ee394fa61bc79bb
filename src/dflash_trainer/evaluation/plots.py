"""PNGs of eval: the measured acceptance (conditional acceptance per draft position and the
histogram) and the speedup curve over batch sizes, drawn and written as the training report's
(telemetry/report.py `new_figure`, `save_png`; matplotlib imported lazily)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_trainer.telemetry.report import new_figure, save_png


def _save(fig: Any, title: str, path: str | Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, path)


def plot_acceptance(conditional: Sequence[float | None], histogram: Sequence[int], path: str | Path, *,
                    title: str = "", tau: float | None = None, offline_tau: float | None = None) -> Path:
    """Left: P(draft k accepted | drafts < k accepted) for k = 1 … B−1. Right: rounds by number of
    accepted drafts n = 0 … B−1. Writes a PNG at `path` (parent folders created) and returns it."""
    fig = new_figure((10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ks = [k for k, c in enumerate(conditional, start=1) if c is not None]
    ax1.plot(ks, [conditional[k - 1] for k in ks], marker="o")
    ax1.set_xlabel("draft position k")
    ax1.set_ylabel("P(accept k | accepted 1..k-1)")
    ax1.set_ylim(0.0, 1.02)
    ax1.set_xticks(range(1, len(conditional) + 1))
    ax1.grid(alpha=0.3)
    ax2.bar(range(len(histogram)), histogram)
    ax2.set_xlabel("accepted drafts per round n (round adds n+1 tokens)")
    ax2.set_ylabel("rounds")
    ax2.set_xticks(range(len(histogram)))
    parts = [title] if title else []
    if tau is not None:
        parts.append(f"measured τ = {tau:.2f}")
    if offline_tau is not None:
        parts.append(f"offline τ = {offline_tau:.2f}")
    return _save(fig, "   ".join(parts), path)


def plot_speedup(table: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Left: plain and speculative tok/s over batch size (log-log). Right: speedup (speculative ÷
    plain; the dashed line at 1 separates faster from slower) at the full draft length with τ
    written at each point, and at the chosen draft length k (labelled) where the records have one.
    `table` holds evaluation/speedup.py records. Writes a PNG at `path` and returns it."""
    bs = [r["batch_size"] for r in table]
    fig = new_figure((10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(bs, [r["plain_tokens_per_s"] for r in table], marker="o", label="plain")
    ax1.plot(bs, [r["speculative_tokens_per_s"] for r in table], marker="o", label="speculative")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("generated tokens / s")
    ax1.legend()
    ax1.grid(alpha=0.3, which="both")
    ax2.plot(bs, [r["speedup"] for r in table], marker="o", label="all B−1 drafts")
    if all("chosen_speedup" in r for r in table):
        ax2.plot(bs, [r["chosen_speedup"] for r in table], marker="s", label="chosen draft length k")
        for r in table:
            ax2.annotate(f"k {r['chosen_draft_length']}", (r["batch_size"], r["chosen_speedup"]),
                         textcoords="offset points", xytext=(0, -12), ha="center", fontsize=8)
        ax2.legend()
    ax2.axhline(1.0, color="grey", linestyle="--")
    for r in table:
        if r["tau"] is not None:
            ax2.annotate(f"τ {r['tau']:.2f}", (r["batch_size"], r["speedup"]), textcoords="offset points",
                         xytext=(0, 6), ha="center", fontsize=8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("speedup (speculative / plain tok/s)")
    ax2.grid(alpha=0.3)
    return _save(fig, title, path)
