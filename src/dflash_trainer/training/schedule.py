"""The row schedule of a run: which dataset rows each micro-batch holds, and the seeds of each
row's anchors.

Symbols (as in pipeline/layout.py): N = target ranks, M = drafter ranks, G = rows per optimizer step
(global, `rows_per_step`), R = G / M rows per drafter per step, s = global step, u = micro-batch index.

Schedule (deterministic for any N:M; the same on every rank, so no rank ever asks another what
comes next):
  batch step s takes rows order_e[b·G, (b+1)·G) where e = s // steps_per_epoch, b = s % steps_per_epoch
  and order_e = `loader.epoch_order(num_rows, seed, e)`; the last step of an epoch is padded with
  row −1 (all-unsupervised rows that add nothing to any loss or count). Optimizer step t trains on
  batch step t // n (n = anchor_draws_per_row, feature reuse); below, "step" means batch step.
  micro-batch u = s·M + d holds drafter d's R rows of step s, [d·R, (d+1)·R) of the step's rows.
  drafter of u = u mod M. Targets feed drafters of their own node, round robin: with m drafters
  and n targets per node, drafter d = node·m + j, the node's micro-batch counter v = s·m + j and
  target of u = node·n + (v mod n). On one node that is simply u mod N. Every target gets every
  n-th micro-batch of its node and produces its micro-batches in increasing u.
  The anchors of each dataset row are drawn from a generator seeded by (seed, epoch, row, draw)
  (`anchor_seeds`), so they depend neither on which rank computes them nor on the split of rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer (Steele, Lea, Flood 2014) on uint64 arrays: a bijective bit mixer."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFF_FFFF_FFFF_FFFF)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(0xFFFF_FFFF_FFFF_FFFF)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(0xFFFF_FFFF_FFFF_FFFF)
    return x ^ (x >> np.uint64(31))


def anchor_seeds(seed: int, epoch: int, rows: np.ndarray, draw: int = 0) -> np.ndarray:
    """Seeds [R] int64 (non-negative) of the anchor generators of dataset rows `rows` [R] (−1 =
    padding) in `epoch`, for anchor draw `draw` (0 ≤ draw < anchor_draws_per_row): the fields are
    mixed one after another through SplitMix64, vectorized over the rows (a few µs per step);
    training/loop.py row_generators."""
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full(len(rows), int(seed) & 0xFFFF_FFFF_FFFF_FFFF, dtype=np.uint64))
        for field in (np.uint64(int(epoch)), np.asarray(rows, dtype=np.int64).astype(np.uint64) + np.uint64(1),
                      np.uint64(int(draw))):
            h = _splitmix64(h ^ field)
    return (h & np.uint64(0x7FFF_FFFF_FFFF_FFFF)).astype(np.int64)


def anchor_seed(seed: int, epoch: int, row: int, draw: int = 0) -> int:
    """`anchor_seeds` of one row."""
    return int(anchor_seeds(seed, epoch, np.array([row]), draw)[0])


# A run over more passes of its rows than this, or validated on fewer rows than this, says so at the start.
# 10: the measured SmolLM2 recipe (benchmarks/reports/2026-12-06-recipe-cmd-h100.md) makes 8.2 passes over its
# 5,844 rows; its held-out τ rose to 6.2 passes and held, with no drop, to the end.
MAX_EPOCHS_WITHOUT_WARNING = 10
MIN_VALIDATION_ROWS = 8


@dataclass(frozen=True)
class RowSchedule:
    """Which dataset rows micro-batch u holds (see the module docstring). Pure; the same on every rank."""

    num_rows: int
    rows_per_step: int  # G
    num_drafters: int  # M
    seed: int
    anchor_draws: int = 1  # optimizer steps per batch step (feature reuse)

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError("the training split has no rows; prepare more data")
        if self.rows_per_step % self.num_drafters:
            raise ValueError(f"rows_per_step={self.rows_per_step} must be a multiple of the drafter count {self.num_drafters}")

    @property
    def rows_per_drafter(self) -> int:
        return self.rows_per_step // self.num_drafters

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.rows_per_step)

    def total_steps(self, max_steps: int | None, epochs: int) -> int:
        """Optimizer steps: max_steps when set (more passes over the rows if needed), else `epochs`
        full passes of `anchor_draws` steps per batch."""
        return max_steps or self.steps_per_epoch * epochs * self.anchor_draws

    def batch_steps(self, total_steps: int) -> int:
        """Batch steps (what the target ranks compute and send) behind `total_steps` optimizer steps;
        optimizer step s trains on batch step s // anchor_draws."""
        return math.ceil(total_steps / self.anchor_draws)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def valid_rows(self, step: int) -> int:
        """Dataset rows (not padding) in step `step`, over all drafters."""
        b = step % self.steps_per_epoch
        return min(self.rows_per_step, self.num_rows - b * self.rows_per_step)

    def small_data_warnings(self, total_steps: int, validation_rows: int | None = None) -> list[str]:
        """One line per way the data is too small for the run, with the numbers (empty when it is
        not): `total_steps` optimizer steps that pass over the training rows more than
        MAX_EPOCHS_WITHOUT_WARNING times (the drafter learns the rows by heart and its offline τ on
        them overstates τ on new prompts), and a validation split of fewer than
        MIN_VALIDATION_ROWS rows (its τ and accuracies are then noise); None = not validated here."""
        out = []
        epochs = total_steps / (self.steps_per_epoch * self.anchor_draws)
        if epochs > MAX_EPOCHS_WITHOUT_WARNING:
            out.append(f"{total_steps} steps of {rows_text(self.rows_per_step)} are {epochs:.1f} passes over the "
                       f"{self.num_rows} training rows (more than {MAX_EPOCHS_WITHOUT_WARNING}): the drafter will "
                       "learn them by heart; give more data or fewer steps (optim.max_steps, optim.epochs)")
        if validation_rows is not None and validation_rows < MIN_VALIDATION_ROWS:
            out.append(f"the validation split holds {rows_text(validation_rows)} (fewer than {MIN_VALIDATION_ROWS}): its "
                       "τ and accuracies are noise; give more data or raise data.validation_fraction")
        return out

    def rows_of(self, unit: int) -> tuple[int, np.ndarray]:
        """(epoch, rows [R] int64) of micro-batch `unit`; −1 marks padding past the end of the epoch."""
        step, d = divmod(unit, self.num_drafters)
        epoch, b = divmod(step, self.steps_per_epoch)
        order = _epoch_order(self.num_rows, self.seed, epoch)
        r = self.rows_per_drafter
        lo = b * self.rows_per_step + d * r
        out = np.full(r, -1, dtype=np.int64)
        got = order[lo:min(lo + r, self.num_rows)]
        out[:len(got)] = got
        return epoch, out



@lru_cache(maxsize=4)
def _epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    from dflash_trainer.data.loader import epoch_order  # imports torch: not needed to check flags

    order = epoch_order(num_rows, seed, epoch)
    order.setflags(write=False)
    return order


def rows_text(n: int) -> str:
    """'1 row' or 'N rows'."""
    return f"{n:,} row" if n == 1 else f"{n:,} rows"
