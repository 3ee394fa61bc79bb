"""Target outputs kept on the device across epochs: the frozen target runs once per dataset row.

The target is frozen and a packed row's features do not depend on which other rows share its
batch (rows are independent in the batch dimension), so the aux hidden states, greedy labels and
final hidden states of dataset row r are the same in every epoch. A run of E epochs over the same
rows spends (E − 1)/E of its target forwards recomputing them. For a small target that forward is
half the step: SmolLM2-135M over 8 × 4,096 tokens takes 33 ms of a 68 ms co-located step on an
H200 (benchmarks/README.md, "Where the step's time goes").

`FeatureCache` stores the outputs of the first rows it sees, up to a byte budget
(`feature_cache_gib`), in preallocated device tensors indexed by a host-side slot map:
  - a batch whose rows are all stored is served from the cache (one row copy per output and row);
  - otherwise the target runs on the rows not stored (all of them in the first epoch, where the
    results are bit-identical to the uncached run) and the new rows are stored while space lasts;
  - padding rows (row index −1) are never stored.
Every lookup is host bookkeeping on the row indices; no device value is read, so there is no host
sync. Outputs a run does not need are not stored: features when the run zeroes them anyway (the
no-target-features control: zeros are served), labels or final hidden states when the objective
does not read them (they are None from the target already).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dflash_trainer.target_model.features import TargetOutput

Rows = dict[str, torch.Tensor]
GIB = 1 << 30


class FeatureCache:
    """Device copies of the target's outputs for up to `capacity` dataset rows.

    budget_bytes: the most bytes the stored tensors may take (the capacity in rows follows from
    the first batch's output shapes: T·k·H·itemsize for features, T·8 for labels, T·H·itemsize
    for final hidden states). keep_features: False stores no features and serves zeros of the
    right shape (the run zeroes them: `no_target_features`). max_rows: the dataset's row count (no
    more is allocated). Raises ValueError for a negative budget; RuntimeError naming
    feature_cache_gib when the device cannot hold the store.
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
        self._feature_shape: tuple[int, int, torch.dtype, torch.device] | None = None  # served zeros' T, k·H, dtype, device
        self.rows_served = 0  # rows whose outputs came from the cache
        self.rows_computed = 0  # rows the target ran on (padding included)

    @classmethod
    def from_gib(cls, gib: float, keep_features: bool = True, max_rows: int | None = None) -> "FeatureCache | None":
        """A cache of `gib` GiB for at most `max_rows` rows, or None for 0 (off)."""
        return cls(int(gib * GIB), keep_features, max_rows) if gib > 0 else None

    @property
    def stored_rows(self) -> int:
        return len(self.slot_of)

    def outputs(self, row_index: np.ndarray, rows: Rows, forward: Callable[[Rows], TargetOutput]) -> TargetOutput:
        """The target outputs of the batch `rows` (input_ids / position_ids / loss_mask [R,T] on the
        device) whose dataset rows are `row_index` [R] (−1 = padding): served from the cache where
        stored, from `forward` (rows → TargetOutput) for the rest, which are then stored while the
        budget lasts. Same shapes and dtypes as `forward(rows)`."""
        index = [int(r) for r in np.asarray(row_index).reshape(-1)]
        slots = [self.slot_of.get(r) if r >= 0 else None for r in index]
        miss = [i for i, s in enumerate(slots) if s is None]
        if not miss:
            self.rows_served += len(index)
            return self._gather(slots)
        sub = rows if len(miss) == len(index) else {k: torch.stack([v[i] for i in miss]) for k, v in rows.items()}
        computed = forward(sub)
        self.rows_computed += len(miss)
        self.rows_served += len(index) - len(miss)
        self._store_rows([index[i] for i in miss], computed)
        if len(miss) == len(index):
            return computed
        return self._merge(slots, miss, computed)

    def summary(self) -> dict[str, float | int | None]:
        """Rows stored and served, capacity and GiB taken (for the run's log and summary.json)."""
        used = (self.bytes_per_row or 0) * (self.capacity or 0)
        return {"budget_gib": self.budget_bytes / GIB, "allocated_gib": used / GIB, "capacity_rows": self.capacity,
                "stored_rows": self.stored_rows, "rows_served": self.rows_served, "rows_computed": self.rows_computed}

    # --- storage -------------------------------------------------------------------------------

    def _allocate(self, out: TargetOutput) -> None:
        T, F = out.features.shape[1], out.features.shape[2]
        self._feature_shape = (T, F, out.features.dtype, out.features.device)
        parts = {"argmax": out.argmax, "last_hidden": out.last_hidden}
        if self.keep_features:
            parts["features"] = out.features
        per_row = {k: v[0].numel() * v.element_size() for k, v in parts.items() if v is not None}
        self.bytes_per_row = max(1, sum(per_row.values()))
        self.capacity = self.budget_bytes // self.bytes_per_row
        if self.max_rows is not None:
            self.capacity = min(self.capacity, self.max_rows)
        device = out.features.device
        try:
            self._store = {k: torch.empty((self.capacity, *parts[k].shape[1:]), dtype=parts[k].dtype, device=device)
                           for k in per_row} if self.capacity else {}
        except torch.OutOfMemoryError as e:
            need = self.capacity * self.bytes_per_row / GIB
            raise RuntimeError(f"feature_cache_gib={self.budget_bytes / GIB:g}: the cache of {self.capacity} rows needs "
                               f"{need:.1f} GiB that {device} does not have beside the run; lower feature_cache_gib "
                               f"(rows beyond it are recomputed) or set it to 0") from e

    def _store_rows(self, dataset_rows: list[int], computed: TargetOutput) -> None:
        if self.capacity is None:
            self._allocate(computed)
        for j, r in enumerate(dataset_rows):
            if r < 0 or self.stored_rows >= (self.capacity or 0):
                continue
            slot = self.stored_rows
            for name, store in self._store.items():
                store[slot].copy_(getattr(computed, name)[j])
            self.slot_of[r] = slot

    def _gather(self, slots: list[int | None]) -> TargetOutput:
        def take(name: str) -> torch.Tensor | None:
            store = self._store.get(name)
            return None if store is None else torch.stack([store[s] for s in slots])
        return TargetOutput(features=self._features_of(slots), argmax=take("argmax"), last_hidden=take("last_hidden"))

    def _features_of(self, slots: list[int | None]) -> torch.Tensor:
        if self.keep_features:
            return torch.stack([self._store["features"][s] for s in slots])
        T, F, dtype, device = self._feature_shape
        return torch.zeros(len(slots), T, F, dtype=dtype, device=device)

    def _merge(self, slots: list[int | None], miss: list[int], computed: TargetOutput) -> TargetOutput:
        """Outputs of a batch where rows `miss` come from `computed` (in that order) and the others
        from their cache slots."""
        where = {i: j for j, i in enumerate(miss)}

        def build(name: str, cached: torch.Tensor | None) -> torch.Tensor | None:
            fresh = getattr(computed, name)
            if fresh is None:
                return None
            return torch.stack([fresh[where[i]] if i in where else cached[s] for i, s in enumerate(slots)])

        features = build("features", self._store.get("features")) if self.keep_features else torch.zeros(
            len(slots), *computed.features.shape[1:], dtype=computed.features.dtype, device=computed.features.device)
        return TargetOutput(features=features, argmax=build("argmax", self._store.get("argmax")),
                            last_hidden=build("last_hidden", self._store.get("last_hidden")))
