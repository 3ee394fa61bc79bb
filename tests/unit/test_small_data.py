"""A run on too little data says so when it starts (training/schedule.py `small_data_warnings`), with the
numbers worked by hand below; and user data is read whole unless `data.max_conversations` is set."""

from __future__ import annotations

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.training.schedule import RowSchedule


def test_more_than_ten_passes_over_the_rows_warns_with_the_numbers():
    # 33 rows, 1 row per step: an epoch is 33 steps; 340 steps = 340 / 33 = 10.3 passes > 10
    lines = RowSchedule(33, 1, 1, 0).small_data_warnings(340)
    assert lines == ["340 steps of 1 row are 10.3 passes over the 33 training rows (more than 10): the drafter will "
                     "learn them by heart; give more data or fewer steps (optim.max_steps, optim.epochs)"]
    assert RowSchedule(33, 1, 1, 0).small_data_warnings(330) == []  # 330 / 33 = 10.0 passes: not more than 10
    # 100 rows, 8 per step: ceil(100 / 8) = 13 steps an epoch; 2 draws per batch: 26 optimizer steps an epoch;
    # 270 steps = 10.4 passes (warns), 260 = 10.0 (does not)
    assert "10.4 passes over the 100 training rows" in RowSchedule(100, 8, 1, 0, 2).small_data_warnings(270)[0]
    assert RowSchedule(100, 8, 1, 0, 2).small_data_warnings(260) == []
    # the measured recipe: 6,000 steps of 8 rows over 5,844 rows = 731 steps an epoch, 8.2 passes: no warning
    assert RowSchedule(5844, 8, 1, 0).small_data_warnings(6000) == []


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
