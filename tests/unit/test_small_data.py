"""A run on too little data says so when it starts (training/schedule.py `small_data_warnings`), with the
numbers worked by hand below; and user data is read whole unless `data.max_conversations` is set."""

from __future__ import annotations

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.training.schedule import RowSchedule


def test_more_than_four_passes_over_the_rows_warns_with_the_numbers():
    # 33 rows, 1 row per step: an epoch is 33 steps; 160 steps = 160 / 33 = 4.85 passes > 4
    lines = RowSchedule(33, 1, 1, 0).small_data_warnings(160)
    assert lines == ["160 steps of 1 rows are 4.8 passes over the 33 training rows (more than 4): the drafter will "
                     "learn them by heart; give more data or fewer steps (optim.max_steps, optim.epochs)"]
    assert RowSchedule(33, 1, 1, 0).small_data_warnings(132) == []  # 132 / 33 = 4.0 passes: not more than 4
    # 100 rows, 8 per step: ceil(100 / 8) = 13 steps an epoch; 2 draws per batch: 26 optimizer steps an epoch;
    # 120 steps = 4.6 passes (warns), 104 = 4.0 (does not)
    assert "4.6 passes over the 100 training rows" in RowSchedule(100, 8, 1, 0, 2).small_data_warnings(120)[0]
    assert RowSchedule(100, 8, 1, 0, 2).small_data_warnings(104) == []


def test_a_handful_of_validation_rows_warns():
    schedule = RowSchedule(1000, 8, 1, 0)
    assert schedule.small_data_warnings(10, validation_rows=3) == [
        "the validation split holds 3 rows (fewer than 8): its τ and accuracies are noise; give more data or raise "
        "data.validation_fraction"]
    assert schedule.small_data_warnings(10, validation_rows=8) == []
    assert schedule.small_data_warnings(10, validation_rows=None) == []  # not validated in this process


def test_no_demo_caps_on_user_data():
    """`train --data FILE` reads every conversation and trains `optim.epochs` passes unless told otherwise;
    the short CPU run's caps live in configs/smoke-cpu.yaml."""
    from pathlib import Path

    from dflash_trainer.config.load import load_config

    cfg = TrainConfig()
    assert cfg.data.max_conversations is None and cfg.optim.max_steps is None
    smoke = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "smoke-cpu.yaml"))
    assert (smoke.data.max_conversations, smoke.optim.max_steps, smoke.drafter.num_layers, smoke.drafter.block_size) == (
        600, 160, 3, 8)
