"""PNG of the measured acceptance: conditional acceptance per draft position and the histogram.

matplotlib with the Agg backend (no display needed); imported lazily so the rest of the package
does not pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_acceptance(conditional: Sequence[float | None], histogram: Sequence[int], path: str | Path, *,
                    title: str = "", tau: float | None = None, offline_tau: float | None = None) -> Path:
    """Left: P(draft k accepted | drafts < k accepted) for k = 1 … B−1. Right: rounds by number of
    accepted drafts n = 0 … B−1. Writes a PNG at `path` (parent folders created) and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.suptitle("   ".join(parts))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
