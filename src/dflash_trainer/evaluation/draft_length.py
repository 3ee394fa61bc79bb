"""The draft length k each batch size should verify: predicted from measured acceptance and
measured round costs, then measured (evaluation/speedup.py).

B = block size; k = drafts per round (0 … B−1; 0 = plain decoding), each round drafting from a block of
k+1 slots as vLLM and SGLang run it (decoding/engine.py). The conditional acceptance
c_i = P(draft i accepted | drafts < i accepted) (decoding/acceptance.py) is measured at the full
k = B−1 and taken for every shorter block too: an estimate (a block of k+1 can draft otherwise than
the first k of the whole block, its attention being bidirectional), so the chosen k is measured
afterwards (evaluation/speedup.py). A round of draft length k then commits, per row,

  E(k) = 1 + c_1 + c_1·c_2 + … + c_1·…·c_k        tokens (the accepted drafts and the bonus token)

in t(k) seconds, measured: one speculative round at k (the drafter's forward over k+1 slots and a
verify forward of k+1 tokens per row, both as decoding runs them), and t(0) = one plain step. The
predicted speedup over plain decoding is E(k)·t(0) / t(k), tokens/s b·E(k) / t(k) at batch size
b, and the chosen k maximizes it (the smaller k on a tie: less verify work for the same speed).
Example: c = [0.8, 0.7, 0.5] gives E = [1, 1.8, 2.36, 2.64]; with t = [10, 12, 16, 22] ms,
E/t = [0.1, 0.15, 0.1475, 0.12] tokens per ms per row, so k = 1 (1.5× plain).

The model ignores rows that finish mid-round (the eos or the cap cuts a round's tokens) and
assumes rows accept independently of one another; the chosen k is measured afterwards, so the
table reports both. The same per-round choice is what engines that set the draft length per
batch size make (vLLM dynamic speculation, SGLang verify budgets); this one is made once per batch
size, from the whole run, and `evaluation/speedup.py` `recommend` serves the fastest measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from dflash_trainer.decoding.engine import DecodeEngine


def tokens_per_round(conditional: Sequence[float | None], k: int) -> float:
    """E(k) (module docstring): expected tokens a round of draft length k commits per row, from
    the conditional acceptance c_1 … c_{B−1}; a position no round reached (None) counts as never
    accepted. Raises ValueError for k outside 0 … len(conditional)."""
    if not 0 <= k <= len(conditional):
        raise ValueError(f"draft length {k} outside 0 … {len(conditional)}")
    expected, reach = 1.0, 1.0
    for c in conditional[:k]:
        reach *= c or 0.0
        expected += reach
    return expected


def predict_draft_lengths(conditional: Sequence[float | None], round_s: Sequence[float],
                          batch_size: int) -> list[dict[str, Any]]:
    """One prediction per draft length k = 0 … B−1 (module docstring): draft_length, round_s
    (t(k), seconds), tokens_per_round (E(k), per row), tokens_per_s (b·E(k)/t(k)) and speedup
    (E(k)·t(0)/t(k)). round_s[k] = t(k), len B; conditional len B−1. Raises ValueError for
    mismatched lengths or a non-positive time."""
    if len(round_s) != len(conditional) + 1:
        raise ValueError(f"{len(round_s)} round times for {len(conditional)} draft positions: need one per "
                         "draft length 0 … B−1")
    if any(t <= 0 for t in round_s):
        raise ValueError(f"round times {list(round_s)} must all be > 0 seconds")
    out = []
    for k, t in enumerate(round_s):
        e = tokens_per_round(conditional, k)
        out.append({"draft_length": k, "round_s": t, "tokens_per_round": e, "tokens_per_s": batch_size * e / t,
                    "speedup": e * round_s[0] / t})
    return out


def best_draft_length(predicted: Sequence[dict[str, Any]]) -> int:
    """The draft length of the highest predicted speedup; the smallest such k on a tie."""
    best = max(p["speedup"] for p in predicted)
    return min(p["draft_length"] for p in predicted if p["speedup"] == best)


def measure_round_costs(engine: DecodeEngine, prompts: list[list[int]], *, repeats: int = 5) -> list[float]:
    """t(k) for k = 0 … B−1 (seconds, the median of `repeats` single steps): per k, the engine's
    draft length is set to k, the prompts (one batch, ≤ the engine's rows) are prefilled, one
    untimed step runs (lazy kernels of the new shape), then `repeats` timed steps
    (`DecodeEngine.timed_step`: graph replays on CUDA, eager on the CPU). Steps continue the
    decode, so finished rows ride along as in decoding. The engine's draft length is restored.
    Raises ValueError for repeats < 1."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    keep, costs = engine.k, []
    for k in range(engine.B):
        engine.set_draft_length(k)
        engine.start(prompts, speculative=True)
        engine.timed_step(speculative=True)  # untimed warm-up step
        costs.append(statistics.median(engine.timed_step(speculative=True) for _ in range(repeats)))
    engine.set_draft_length(keep)
    return costs
