"""The feature cache (training/feature_cache.py) against a fake target whose outputs encode the row:
what is stored, what is served, what is recomputed, and that served outputs equal the target's."""

import numpy as np
import pytest
import torch

from dflash_trainer.target_model.features import TargetOutput
from dflash_trainer.training.feature_cache import GIB, FeatureCache

T, F, H = 6, 4, 3


class FakeTarget:
    """Outputs computed from input_ids (row r holds token id r + 10 everywhere), so a served row can be
    checked against what the target would give: features = id + column / 10, argmax = id + 1,
    last_hidden = −id. Records the ids of every row it ran on."""

    def __init__(self, last_hidden: bool = True):
        self.calls: list[list[int]] = []
        self.last_hidden = last_hidden

    def __call__(self, rows):
        ids = rows["input_ids"]
        self.calls.append(ids[:, 0].tolist())
        f = ids[..., None].to(torch.float32) + torch.arange(F, dtype=torch.float32) / 10
        lh = -ids[..., None].to(torch.float32).expand(-1, -1, H).clone() if self.last_hidden else None
        return TargetOutput(features=f.to(torch.bfloat16), argmax=ids + 1, last_hidden=lh)


def rows_of(dataset_rows):
    ids = torch.tensor([[max(r, 0) + 10] * T for r in dataset_rows], dtype=torch.int64)
    return {"input_ids": ids, "position_ids": torch.arange(T).expand(len(dataset_rows), T).clone(),
            "loss_mask": torch.ones(len(dataset_rows), T, dtype=torch.bool)}


def expected(dataset_rows, last_hidden=True):
    return FakeTarget(last_hidden)(rows_of(dataset_rows))


def same(a: TargetOutput, b: TargetOutput):
    assert torch.equal(a.features, b.features) and a.features.dtype == b.features.dtype
    assert torch.equal(a.argmax, b.argmax)
    assert (a.last_hidden is None) == (b.last_hidden is None)
    if a.last_hidden is not None:
        assert torch.equal(a.last_hidden, b.last_hidden)


def row_bytes():
    return T * F * 2 + T * 8 + T * H * 4  # bf16 features, int64 labels, fp32 last hidden


def test_second_epoch_is_served_without_the_target_and_equals_it():
    """Prevents a cache that recomputes stored rows, serves another row's outputs, or changes a value."""
    target, cache = FakeTarget(), FeatureCache(10 * row_bytes())
    for batch in ([3, 0], [2, 1]):
        same(cache.outputs(np.array(batch), rows_of(batch), target), expected(batch))
    assert target.calls == [[13, 10], [12, 11]]  # epoch 1: every row once
    for batch in ([1, 3], [0, 2]):  # epoch 2, reshuffled
        same(cache.outputs(np.array(batch), rows_of(batch), target), expected(batch))
    assert len(target.calls) == 2  # no forward in epoch 2
    assert cache.summary()["rows_served"] == 4 and cache.summary()["rows_computed"] == 4
    assert cache.capacity == 10 and cache.stored_rows == 4


def test_a_budget_for_two_rows_recomputes_only_the_rest():
    """Prevents a full-batch forward when only some rows are missing, or storing beyond the budget:
    with room for 2 rows (the first two seen), a batch mixing stored and new rows runs the target on
    the new rows alone and merges them in batch order."""
    target, cache = FakeTarget(), FeatureCache(2 * row_bytes() + row_bytes() // 2)
    cache.outputs(np.array([4, 1, 0]), rows_of([4, 1, 0]), target)
    assert cache.capacity == 2 and sorted(cache.slot_of) == [1, 4]
    got = cache.outputs(np.array([0, 4, 2, 1]), rows_of([0, 4, 2, 1]), target)
    same(got, expected([0, 4, 2, 1]))
    assert target.calls[-1] == [10, 12]  # rows 0 and 2 only
    assert cache.stored_rows == 2  # still full: rows 0 and 2 not stored
    assert cache.summary()["allocated_gib"] == pytest.approx(2 * row_bytes() / GIB)


def test_padding_rows_are_never_stored_and_zeros_once_rows_are_served():
    """First epoch: the whole batch through the target, as without the cache. Later: a padding row
    (no loss) is zeros, not a one-row target forward (a new batch size for the compiled target)."""
    target, cache = FakeTarget(), FeatureCache(10 * row_bytes())
    same(cache.outputs(np.array([5, -1]), rows_of([5, -1]), target), expected([5, -1]))
    got = cache.outputs(np.array([5, -1]), rows_of([5, -1]), target)
    assert target.calls == [[15, 10]]  # no forward for the second batch
    ref = expected([5, -1])
    assert torch.equal(got.features[0], ref.features[0]) and torch.equal(got.argmax[0], ref.argmax[0])
    assert not got.features[1].any() and not got.argmax[1].any() and not got.last_hidden[1].any()
    assert list(cache.slot_of) == [5]


def test_missing_rows_run_in_power_of_two_batches():
    """Prevents a target forward per distinct number of missing rows (each a recompile of the
    compiled target): 3 missing rows of 8 run as 4 (the last repeated), 5 as the whole batch."""
    target, cache = FakeTarget(), FeatureCache(100 * row_bytes(), max_rows=2)
    cache.outputs(np.array([0, 1]), rows_of([0, 1]), target)  # rows 0 and 1 stored, the cache full
    batch = [0, 2, 3, 1, 4, -1, -1, -1]
    got, ref = cache.outputs(np.array(batch), rows_of(batch), target), expected(batch)
    assert torch.equal(got.features[:5], ref.features[:5]) and torch.equal(got.argmax[:5], ref.argmax[:5])
    assert not got.features[5:].any()  # padding
    assert target.calls[-1] == [12, 13, 14, 14]
    batch = [0, 2, 3, 4, 5, 6, 1, 7]
    same(cache.outputs(np.array(batch), rows_of(batch), target), expected(batch))
    assert target.calls[-1] == [10, 12, 13, 14, 15, 16, 11, 17]


def test_a_row_twice_in_one_batch_takes_one_slot():
    target, cache = FakeTarget(), FeatureCache(10 * row_bytes())
    cache.outputs(np.array([4, 4, 7]), rows_of([4, 4, 7]), target)
    assert cache.slot_of == {4: 0, 7: 1}
    same(cache.outputs(np.array([7, 4]), rows_of([7, 4]), target), expected([7, 4]))


def test_zeroed_features_are_not_stored_and_served_as_zeros():
    """The control run (no_target_features) stores labels only; a served batch has zero features of
    the target's shape and dtype (the step zeroes them anyway)."""
    target, cache = FakeTarget(last_hidden=False), FeatureCache(10 * T * 8, keep_features=False)
    cache.outputs(np.array([0, 1]), rows_of([0, 1]), target)
    assert cache.bytes_per_row == T * 8 and "features" not in cache._store
    got = cache.outputs(np.array([1, 0]), rows_of([1, 0]), target)
    assert len(target.calls) == 1
    assert got.features.shape == (2, T, F) and got.features.dtype == torch.bfloat16 and not got.features.any()
    assert torch.equal(got.argmax, expected([1, 0], last_hidden=False).argmax) and got.last_hidden is None
    mixed = cache.outputs(np.array([1, 7]), rows_of([1, 7]), target)  # room left: row 7 is computed, then stored
    assert not mixed.features.any() and torch.equal(mixed.argmax, expected([1, 7]).argmax)


def test_off_and_bad_budgets():
    assert FeatureCache.from_gib(0) is None
    assert FeatureCache.from_gib(0.5).budget_bytes == GIB // 2
    with pytest.raises(ValueError, match="feature_cache_gib"):
        FeatureCache(-1)


def test_capacity_is_capped_by_the_dataset():
    """A budget larger than the data allocates the data's rows only."""
    cache = FeatureCache(100 * row_bytes(), max_rows=3)
    cache.outputs(np.array([0, 1]), rows_of([0, 1]), FakeTarget())
    assert cache.capacity == 3 and cache._store["features"].shape == (3, T, F)


def test_an_out_of_memory_error_after_the_store_names_the_budget():
    """Prevents a plain OOM in a later step when the cache took the memory: once rows are stored, an
    OutOfMemoryError inside `explain_oom` is re-raised as the same type naming feature_cache_gib, the
    GiB held and the fix; before anything is stored, and for other errors, the error passes as is."""
    budget = GIB // 4  # large enough that the GiB held shows in the message (about 0.25 GiB, allocated uninitialized)
    cache = FeatureCache(budget)
    with pytest.raises(torch.OutOfMemoryError, match="^CUDA out of memory$"):
        with cache.explain_oom():
            raise torch.OutOfMemoryError("CUDA out of memory")  # nothing stored yet
    cache.outputs(np.array([0]), rows_of([0]), FakeTarget())
    with pytest.raises(torch.OutOfMemoryError) as err:
        with cache.explain_oom():
            raise torch.OutOfMemoryError("CUDA out of memory")
    msg = str(err.value)
    assert cache.capacity == budget // row_bytes()
    assert "holding 0.2 GiB" in msg and "feature_cache_gib=0.25" in msg  # capacity × bytes per row just under 0.25
    assert "lower feature_cache_gib" in msg and msg.endswith("CUDA out of memory")
    with pytest.raises(ValueError, match="other"):
        with cache.explain_oom():
            raise ValueError("other")
