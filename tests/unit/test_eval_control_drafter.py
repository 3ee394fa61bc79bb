"""The control drafter (`--no-target-features`): trained and evaluated on zeroed target features."""

from __future__ import annotations

import pytest
import torch
from test_eval_common import target_and_drafter

from dflash_trainer.config.load import load_config
from dflash_trainer.training.step import StepSettings, drafter_step

pytestmark = pytest.mark.usefixtures("one_thread")

def _sums(drafter, features, zero):
    T = features.shape[1]
    rows = {"input_ids": torch.randint(3, 100, (1, T), generator=torch.Generator().manual_seed(0)),
            "position_ids": torch.arange(T)[None], "loss_mask": torch.ones(1, T, dtype=torch.bool)}
    settings = StepSettings(num_anchors=8, gamma=4.0, label_source="data", zero_features=zero)
    return drafter_step(drafter, rows, features, None, settings, torch.Generator().manual_seed(1))


def test_zeroed_features_make_the_step_blind_to_the_target():
    """With no_target_features the loss cannot depend on the target's hidden states (the control
    the paper compares against); without it, it does."""
    bundle, drafter = target_and_drafter()
    f1 = torch.randn(1, 40, 2 * bundle.hidden_size)
    f2 = torch.randn(1, 40, 2 * bundle.hidden_size)
    assert torch.equal(_sums(drafter, f1, True).loss_sum, _sums(drafter, f2, True).loss_sum)
    assert not torch.equal(_sums(drafter, f1, False).loss_sum, _sums(drafter, f2, False).loss_sum)


def test_config_flag():
    assert load_config(None, {"no_target_features": True}).experimental.no_target_features is True
    assert load_config(None, {}).experimental.no_target_features is False
