"""End-of-run validation: a row and time budget that says how much it covered, progress lines when
the output is not a terminal, and the same numbers as validating the chosen rows by hand."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from dflash_trainer.config.schema import TrainConfig, saved_config
from dflash_trainer.config.load import load_config
from dflash_trainer.data.loader import epoch_order
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.features import TargetFeatureExtractor
from tests.tiny_targets import bundle_from_model, tiny_llama
from dflash_trainer.training.checkpoint import check_resumable
from dflash_trainer.training.step import StepSettings, drafter_step
from dflash_trainer.training.validate import coverage, validate_rows

T, V, ROWS, SEED = 128, 128, 5, 3


@pytest.fixture(scope="module")
def setup():
    from datasets import Dataset

    rng = np.random.default_rng(0)
    pos = np.concatenate([np.arange(T // 2), np.arange(T // 2)])
    rows = Dataset.from_dict({"input_ids": rng.integers(3, V - 1, (ROWS, T)).tolist(),
                              "loss_mask": [(pos >= 8).astype(np.int8).tolist()] * ROWS,
                              "position_ids": [pos.tolist()] * ROWS})
    target = bundle_from_model(tiny_llama(num_layers=3, seed=1))
    dc = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=V, block_size=4, mask_token_id=V - 1,
                       target_layer_ids=[0, 2], num_target_layers=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dc, target.embed_tokens, target.lm_head)
    settings = StepSettings(num_anchors=8, gamma=4.0, mask_kind="dense")
    return rows, TargetFeatureExtractor(target, dc.target_layer_ids), drafter, settings


def _validate(setup, **budget):
    rows, extractor, drafter, settings = setup
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    got = validate_rows(drafter, extractor, rows, settings, torch.device("cpu"), SEED, console, **budget)
    return got, buf.getvalue().splitlines()


@torch.no_grad()
def _by_hand(setup, n):
    """Loss and exact τ of the first n rows of the (seed, epoch 0) order, one row per call, the
    anchor generator seeded with seed + 1 — what validation promises to compute."""
    rows, extractor, drafter, settings = setup
    drafter.eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    loss = weight = run = blocks = 0.0
    for i in epoch_order(len(rows), SEED, 0)[:n]:
        r = rows[[int(i)]]
        batch = {"input_ids": torch.tensor(r["input_ids"]), "position_ids": torch.tensor(r["position_ids"]),
                 "loss_mask": torch.tensor(r["loss_mask"]).bool()}
        out = extractor(batch["input_ids"], batch["position_ids"], need_argmax=True)
        s = drafter_step(drafter, batch, out.features, out.argmax, settings, gen)
        loss, weight = loss + float(s.loss_sum), weight + float(s.weight_sum)
        run, blocks = run + float(s.run_length_sum), blocks + float(s.num_blocks)
    drafter.train()
    return loss / weight, 1 + run / blocks


def test_row_budget_validates_the_first_rows_and_says_so(setup):
    """Prevents a silently partial validation: a row budget keeps the first rows of the fixed order,
    gives their exact numbers, and records how many rows of how many and which budget cut it."""
    got, lines = _validate(setup, max_rows=2)
    assert (got["rows_validated"], got["rows_total"], got["cut_by"]) == (2, ROWS, "validation_max_rows")
    loss, tau = _by_hand(setup, 2)
    assert got["loss"] == pytest.approx(loss, rel=1e-6) and got["tau_exact"] == pytest.approx(tau, rel=1e-9)
    assert coverage(got) == "2 of 5 rows (validation_max_rows reached)"
    assert [ln.split()[:3] for ln in lines] == [["validate", "row", "1/2"], ["validate", "row", "2/2"]]
    for part in ("loss ", "τ≈", "tok/s", "elapsed", "ETA"):
        assert part in lines[-1], (part, lines[-1])
    assert f"loss {loss:.3f}" in lines[-1]  # the running loss shown is the validation loss


def test_no_budget_or_a_large_one_validates_every_row(setup):
    """Prevents a budget that is not reached from changing the result or claiming a cut."""
    full, _ = _validate(setup)
    roomy, _ = _validate(setup, max_rows=100, max_seconds=1e6)
    assert (full["rows_validated"], full["cut_by"]) == (ROWS, None) and coverage(full) == "all 5 rows"
    assert roomy["loss"] == full["loss"] and roomy["cut_by"] is None
    assert full["loss"] == pytest.approx(_by_hand(setup, ROWS)[0], rel=1e-6)


def test_time_budget_stops_after_the_row_in_progress(setup):
    """Prevents validation running unbounded on a slow machine: past max_seconds no new row starts,
    at least one row is validated, and the cut is recorded. The budget counts from the end of the
    first row (whose one-off costs, such as compiling the target for a batch of one row, are free),
    so a budget of 1e-9 s validates the first row and the one started at once after it."""
    got, lines = _validate(setup, max_seconds=1e-9)
    assert (got["rows_validated"], got["rows_total"], got["cut_by"]) == (2, ROWS, "validation_max_seconds")
    assert got["loss"] == pytest.approx(_by_hand(setup, 2)[0], rel=1e-6)
    assert lines[-1].startswith("validate row 2/5")


def test_budget_fields_validate_and_never_block_a_resume():
    """Prevents a budget of 0 rows or seconds (nothing validated) and a resume refused only because
    the validation budget changed (it does not change the training math)."""
    cfg = load_config(sets=["validation_max_rows=null", "validation_max_seconds=null"])
    assert cfg.data.validation_max_rows is None and cfg.data.validation_max_seconds is None
    for field in ("validation_max_rows", "validation_max_seconds"):
        with pytest.raises(ValueError, match=field):
            load_config(sets=[f"{field}=0"])
    saved = saved_config(TrainConfig())
    check_resumable({"config": saved}, TrainConfig(validation_max_rows=None, validation_max_seconds=5.0).model_dump(),
                    Path("run/checkpoint-4"), "colocated")


def test_the_progress_total_follows_the_time_budget(setup, monkeypatch):
    """Prevents an ETA that ignores the budget (it promised every planned row). A clock at 1 s per row:
    row 1 ends at t = 1 s (the budget starts), row 2 at 2 s: pace 1 s/row, 1.5 s of a 2.5 s budget left, so
    2 + ceil(1.5) = 4 rows in all; row 3 at 3 s: 3 + ceil(0.5) = 4; row 4 at 4 s is past the budget and the
    last. The lines show 1/5, then 2/4, 3/4, 4/4."""
    import types

    import dflash_trainer.training.validate as validate_mod

    ticks = iter(range(100))
    monkeypatch.setattr(validate_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    got, lines = _validate(setup, max_seconds=2.5)
    assert (got["rows_validated"], got["cut_by"]) == (4, "validation_max_seconds")
    assert [ln.split()[2] for ln in lines] == ["1/5", "2/4", "3/4", "4/4"]
