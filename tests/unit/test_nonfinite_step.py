"""A step with a non-finite loss changes nothing and is counted (no host sync needed)."""

import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.features import TargetFeatureExtractor
from tests.tiny_targets import tiny_bundle
from dflash_trainer.training.optim import build_optimizer
from dflash_trainer.training.loop import Batch, train_step
from dflash_trainer.training.step import StepSettings


def _setup():
    target = tiny_bundle("llama", num_layers=3)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=128, block_size=4, mask_token_id=127,
                        target_layer_ids=[0, 2], num_target_layers=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr=1e-2, weight_decay=0.1)
    T = 32
    pos = torch.cat([torch.arange(16), torch.arange(16)])[None]
    rows = {"input_ids": torch.randint(3, 120, (1, T), generator=torch.Generator().manual_seed(1)),
            "position_ids": pos, "loss_mask": (pos >= 4)}
    settings = StepSettings(num_anchors=8, gamma=2.0, label_source="data")
    return TargetFeatureExtractor(target, cfg.target_layer_ids), drafter, params, opt, rows, settings


class _Poisoned:
    """The target extractor with one NaN written into its features."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        out.features[0, 5] = float("nan")
        return out


def _target(extractor, rows):
    return extractor(rows["input_ids"], rows["position_ids"])


def test_nonfinite_step_is_skipped_and_counted():
    """Prevents one NaN batch from poisoning the weights or the Adam moments."""
    extractor, drafter, params, opt, rows, settings = _setup()
    acc = MetricAccumulator(4, "cpu")
    gen = torch.Generator().manual_seed(0)
    finite = train_step(drafter, Batch.of(rows, _target(extractor, rows)), settings, gen, opt, params, 1.0, acc)
    assert bool(finite)
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]

    finite = train_step(drafter, Batch.of(rows, _target(_Poisoned(extractor), rows)), settings, gen, opt, params, 1.0, acc)
    assert not bool(finite)
    assert all(torch.equal(b, p) for b, p in zip(before, params))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, params))
    assert all(torch.equal(s, opt.state[p]["step"]) for s, p in zip(steps, params))
    summary = acc.summary()
    assert summary["skipped_steps"] == 1 and summary["consecutive_skips"] == 1
    assert summary["loss"] is not None and summary["loss"] == summary["loss"]  # the good step only, finite

    assert bool(train_step(drafter, Batch.of(rows, _target(extractor, rows)), settings, gen, opt, params, 1.0, acc))
    assert any(not torch.equal(b, p) for b, p in zip(before, params))
    assert acc.summary()["consecutive_skips"] == 0
