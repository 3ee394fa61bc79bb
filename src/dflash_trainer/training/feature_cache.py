"""Target outputs kept on the device across epochs: the frozen target runs once per dataset row.

The target is frozen and a packed row's features do not depend on which other rows share its
batch (rows are independent in the batch dimension), so the aux hidden states, greedy labels and
final hidden states of dataset row r are the same in every epoch. A run of E epochs over the same
rows spends (E − 1)/E of its target forwards recomputing them. For a small target that forward is
half the step: SmolLM2-135M over 8 × 4,096 tokens takes 33 ms of a 68 ms co-located step on an
H200 (benchmarks/reports/2026-12-02-step-breakdown.md).

`FeatureCache` stores the outputs of the first rows it sees, up to a byte budget
(`feature_cache_gib`), in preallocated device tensors indexed by a host-side slot map:
  - a batch with no stored row (the whole first epoch) runs the target as without the cache, so
    the first epoch is bit-identical to an uncached run, and its new rows are stored;
  - later, stored rows are served from the cache (one row copy per output and row), padding rows
    (row index −1, no loss) as zeros, and the target runs on the other rows alone, padded to a
    power of two so the compiled target sees few batch sizes (each new one compiles once);
  - rows beyond the budget are recomputed in every epoch.
Every lookup is host bookkeeping on the row indices; no device value is read, so there is no host
sync. Outputs a run does not need are not stored: features when the run zeroes them anyway (the
no-target-features control: zeros are served), labels or final hidden states when the objective
does not read them (they are None from the target already).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.target_model.features import TargetOutput

Rows = dict[str, torch.Tensor]
GIB = 1 << 30


class FeatureCache:
    """Device copies of the target's outputs for up to `capacity` dataset rows.

    budget_bytes: the most bytes the stored tensors may take (the capacity in rows follows from
    the first batch's output shapes: T·k·H·itemsize for features, T·8 for labels, T·H·itemsize
    for final hidden states). keep_features: False stores no features and serves zeros of the
    right shape (the run zeroes them: `no_target_features`). max_rows: the dataset's row count (no
    more is allocated). Raises ValueError for a negative budget; torch.OutOfMemoryError
    naming feature_cache_gib (torch's message kept) when the device cannot hold the store.
    """

    def __init__(self, budget_bytes: int, keep_features: bool = True, max_rows: int | None = None):
        if budget_bytes < 0:
            raise ValueError(f"feature_cache_gib must be ≥ 0, got {budget_bytes / GIB:g} GiB")
        self.budget_bytes = int(budget_bytes)
        self.keep_features = keep_features
        self.max_rows = max_rows
        self.slot_of: dict[int, int] = {}
        self.capacity: int | None = None  # rows; known after the first store
        self.bytes_per_row: int | None = None
        self._store: dict[str, torch.Tensor] = {}
        self._zero_row: dict[str, torch.Tensor] = {}  # per output present: one row of zeros (padding rows)
        self.rows_served = 0  # rows whose outputs came from the cache
        self.rows_computed = 0  # rows the target ran on (padding included)

    @classmethod
    def from_gib(cls, gib: float, keep_features: bool = True, max_rows: int | None = None) -> "FeatureCache | None":
        """A cache of `gib` GiB for at most `max_rows` rows, or None for 0 (off)."""
        return cls(int(gib * GIB), keep_features, max_rows) if gib > 0 else None

    @classmethod
    def for_run(cls, cfg: TrainConfig, num_rows: int) -> "FeatureCache | None":
        """The cache a run's config asks for (TrainConfig `feature_cache_gib`; features not kept when
        `no_target_features` zeroes them) over its `num_rows` training rows, or None when off."""
        return cls.from_gib(cfg.target.feature_cache_gib, keep_features=not cfg.experimental.no_target_features, max_rows=num_rows)

    @property
    def stored_rows(self) -> int:
        return len(self.slot_of)

    def outputs(self, row_index: np.ndarray, rows: Rows, forward: Callable[[Rows], TargetOutput]) -> TargetOutput:
        """The target outputs of the batch `rows` (input_ids / position_ids / loss_mask [R,T] on the
        device) whose dataset rows are `row_index` [R] (−1 = padding). Same shapes and dtypes as
        `forward(rows)` (rows → TargetOutput):
          - no row stored yet (the first epoch): `forward(rows)` itself, as without the cache;
          - otherwise stored rows from the cache, padding rows as zeros (they carry no loss), and the
            other rows from `forward` on those rows alone, padded to a power of two (so the compiled
            target sees at most log2(R) + 1 new batch sizes; R rows = the whole batch again).
        Rows computed are stored while the budget lasts."""
        index = [int(r) for r in np.asarray(row_index).reshape(-1)]
        slots = [self.slot_of.get(r) if r >= 0 else None for r in index]
        miss = [i for i, r in enumerate(index) if r >= 0 and slots[i] is None]
        hits = len(index) - len(miss) - index.count(-1) if self.capacity else 0
        if hits == 0:
            return self._forward_all(index, miss, rows, forward)
        size = 1 << (len(miss) - 1).bit_length() if miss else 0  # the next power of two
        if size >= len(index):
            return self._forward_all(index, miss, rows, forward)
        computed = None
        if miss:
            take = miss + [miss[-1]] * (size - len(miss))
            computed = forward({k: torch.stack([v[i] for i in take]) for k, v in rows.items()})
            self.rows_computed += size
            self._store_rows([index[i] for i in miss], computed, list(range(len(miss))))
        self.rows_served += hits
        return self._assemble(slots, {i: j for j, i in enumerate(miss)}, computed)

    def _forward_all(self, index: list[int], miss: list[int], rows: Rows, forward) -> TargetOutput:
        computed = forward(rows)
        self.rows_computed += len(index)
        self._store_rows([index[i] for i in miss], computed, miss)
        return computed

    @contextmanager
    def explain_oom(self) -> Iterator[None]:
        """Re-raise a device out-of-memory error of the code inside (the training loop) with the
        cache's share named: the store is allocated whole at the first batch, so a budget that
        leaves the step too little memory fails in a later step, not in the allocation. Raises
        torch.OutOfMemoryError (the same type) naming feature_cache_gib, the GiB the store holds and
        the fix; errors when nothing is stored pass unchanged."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            if not self._store:
                raise
            held = self.capacity * self.bytes_per_row / GIB
            raise torch.OutOfMemoryError(
                f"out of device memory with the feature cache holding {held:.1f} GiB (feature_cache_gib="
                f"{self.budget_bytes / GIB:g}): lower feature_cache_gib so the step has room (rows beyond the "
                f"budget are recomputed each epoch), or set it to 0. {e}") from e

    def summary(self) -> dict[str, float | int | None]:
        """Rows stored and served, capacity and GiB taken (for the run's log and summary.json)."""
        used = (self.bytes_per_row or 0) * (self.capacity or 0)
        return {"budget_gib": self.budget_bytes / GIB, "allocated_gib": used / GIB, "capacity_rows": self.capacity,
                "stored_rows": self.stored_rows, "rows_served": self.rows_served, "rows_computed": self.rows_computed}

    # --- storage -------------------------------------------------------------------------------

    def _allocate(self, out: TargetOutput) -> None:
        present = {k: v for k, v in (("features", out.features), ("argmax", out.argmax),
                                     ("last_hidden", out.last_hidden)) if v is not None}
        self._zero_row = {k: torch.zeros_like(v[0]) for k, v in present.items()}
        parts = {k: v for k, v in present.items() if k != "features" or self.keep_features}  # what is stored
        per_row = {k: v[0].numel() * v.element_size() for k, v in parts.items()}
        self.bytes_per_row = max(1, sum(per_row.values()))
        self.capacity = self.budget_bytes // self.bytes_per_row
        if self.max_rows is not None:
            self.capacity = min(self.capacity, self.max_rows)
        device = out.features.device
        try:
            self._store = {k: torch.empty((self.capacity, *parts[k].shape[1:]), dtype=parts[k].dtype, device=device)
                           for k in per_row} if self.capacity else {}
        except torch.OutOfMemoryError as e:  # the same type: the train command names the setting and the amount
            need = self.capacity * self.bytes_per_row / GIB
            raise torch.OutOfMemoryError(
                f"feature_cache_gib={self.budget_bytes / GIB:g}: the cache of {self.capacity} rows needs {need:.1f} GiB "
                f"that {device} does not have beside the run; lower feature_cache_gib (rows beyond it are recomputed) "
                f"or set it to 0. {e}") from e

    def _store_rows(self, dataset_rows: list[int], computed: TargetOutput, positions: list[int]) -> None:
        """Store dataset row dataset_rows[j] from row positions[j] of `computed`, each row once, while
        the capacity lasts."""
        if self.capacity is None:
            self._allocate(computed)
        for r, j in zip(dataset_rows, positions):
            slot = self.stored_rows  # slots fill in order
            if r < 0 or r in self.slot_of or slot >= self.capacity:
                continue
            for name, store in self._store.items():
                store[slot].copy_(getattr(computed, name)[j])
            self.slot_of[r] = slot

    def _assemble(self, slots: list[int | None], fresh: dict[int, int], computed: TargetOutput | None) -> TargetOutput:
        """[R, ...] outputs: row i from its cache slot, from row fresh[i] of `computed`, or zeros
        (padding rows; every row's features when they are not kept)."""
        def row(name: str, i: int, s: int | None) -> torch.Tensor:
            store = self._store.get(name)
            if store is None:  # features the run zeroes (not kept)
                return self._zero_row[name]
            if s is not None:
                return store[s]
            return getattr(computed, name)[fresh[i]] if i in fresh else self._zero_row[name]  # else padding

        def build(name: str) -> torch.Tensor | None:
            if name not in self._zero_row:  # an output the target does not give (None)
                return None
            return torch.stack([row(name, i, s) for i, s in enumerate(slots)])
        return TargetOutput(features=build("features"), argmax=build("argmax"), last_hidden=build("last_hidden"))
