"""Target-feature dropout (PARD-2) in the drafter step: its rate, its unit, training only, seeded by
the step's row generators after the anchors, and a no-op (bit for bit) at feature_dropout = 0.

Shapes: R rows, T packed tokens, k·H feature width.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.feature_dropout import drop_features, feature_keep_mask
from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.training.step import StepSettings, drafter_step, make_blocks, make_masks

V, H, T = 48, 16, 40
SUMS = ("loss_sum", "weight_sum", "correct", "count", "run_length_sum", "num_blocks")


def gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def docs_of(lengths: list[int], length: int) -> torch.Tensor:
    """position_ids [length] of documents with the given lengths, cycled until `length` tokens."""
    out, i = [], 0
    while len(out) < length:
        out.extend(range(lengths[i % len(lengths)]))
        i += 1
    return torch.tensor(out[:length])


def test_position_dropout_rate():
    """Over 32,768 positions the dropped fraction is p within 6σ (a flipped comparison gives 1 − p)."""
    pos = torch.arange(8192).expand(4, 8192)
    keep = feature_keep_mask(pos, 0.1, "position", gens(1, 2, 3, 4))
    assert abs((~keep).float().mean().item() - 0.1) < 0.01


def test_document_dropout_rate_and_unit():
    """Unit 'document': every token of a document shares one decision, and about p of the ~3,300
    documents are dropped; positions inside one document are never split."""
    pos = torch.stack([docs_of([1, 2, 3, 5, 7], 4096) for _ in range(4)])
    keep = feature_keep_mask(pos, 0.25, "document", gens(5, 6, 7, 8))
    starts = pos == 0
    doc_id = torch.cumsum(starts.long(), dim=1)  # [R,T] document number within the row
    for r in range(4):
        for d in doc_id[r].unique():
            assert keep[r, doc_id[r] == d].unique().numel() == 1
    dropped = (~keep[starts]).float().mean().item()
    assert starts.sum() > 3000 and abs(dropped - 0.25) < 0.04


def test_mask_is_seeded_per_row():
    """Same seeds, same mask; a row's mask depends only on its own generator (so on (seed, epoch,
    row, draw), not on the other rows of its micro-batch); another seed gives another mask."""
    pos = torch.stack([docs_of([3, 4], 64), torch.arange(64)])
    a = feature_keep_mask(pos, 0.5, "position", gens(10, 11))
    b = feature_keep_mask(pos, 0.5, "position", gens(10, 11))
    alone = feature_keep_mask(pos[1:], 0.5, "position", gens(11))
    other = feature_keep_mask(pos, 0.5, "position", gens(10, 12))
    assert torch.equal(a, b) and torch.equal(a[1:], alone) and not torch.equal(a[1], other[1])
    assert torch.equal(a[0], other[0])


def test_bad_dropout_settings_name_the_field():
    pos = torch.arange(8)[None]
    with pytest.raises(ValueError, match="feature_dropout="):
        feature_keep_mask(pos, 1.0, "position", None)
    with pytest.raises(ValueError, match="feature_dropout_unit"):
        feature_keep_mask(pos, 0.1, "token", None)


def tiny_drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, vocab_size=V, block_size=4, mask_token_id=V - 1,
                        target_layer_ids=[0, 1], num_target_layers=2)
    return DFlashDrafter(cfg, torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))


def batch(rows: int = 2):
    g = torch.Generator().manual_seed(7)
    pos = torch.stack([docs_of([11, 17, 12], T), docs_of([9, 31], T)])[:rows]
    rows_ = {"input_ids": torch.randint(0, V - 1, (rows, T), generator=g), "position_ids": pos,
             "loss_mask": torch.rand(rows, T, generator=g) > 0.2}
    return rows_, torch.randn(rows, T, 2 * H, generator=g), torch.randint(0, V - 1, (rows, T), generator=g)


def test_zero_dropout_is_bitwise_todays_step():
    """feature_dropout = 0 (and any rate outside training) changes nothing: the sums and gradients are
    bit for bit those of the drafter on the untouched features, and no random number is drawn."""
    drafter = tiny_drafter()
    rows, feats, argmax = batch()
    plain = StepSettings(num_anchors=6, gamma=2.0, position_weights="decay")  # the block_loss written out below
    got = {}
    for name, settings, train in (("train_p0", plain, True), ("eval_p0", plain, False),
                                  ("eval_p05", StepSettings(num_anchors=6, gamma=2.0, position_weights="decay",
                                                            feature_dropout=0.5), False)):
        g = gens(1, 2)
        sums = drafter_step(drafter, rows, feats, argmax, settings, g, train=train)
        sums.loss_sum.backward()
        got[name] = (sums, drafter.fc.weight.grad.clone(), [x.get_state() for x in g])
        drafter.zero_grad()
    g = gens(1, 2)  # today's step written out: blocks, masks, drafter, loss
    blocks = make_blocks(rows, argmax, drafter, plain, g)
    hidden = drafter(feats, rows["position_ids"], blocks.block_input_ids, blocks.block_position_ids,
                     make_masks(blocks, T, drafter, "dense"))
    manual = block_loss(hidden, drafter.lm_head_weight, blocks.labels, blocks.loss_weight, block_size=4,
                        slot_valid=blocks.slot_valid, loss_impl=plain.loss_impl)
    manual.loss_sum.backward()
    for name, (sums, grad, states) in got.items():
        for f in SUMS:
            assert torch.equal(getattr(sums, f), getattr(manual, f)), (name, f)
        assert torch.equal(grad, drafter.fc.weight.grad), name
        assert all(torch.equal(a, b.get_state()) for a, b in zip(states, g)), name  # same draws as today


def test_dropout_trains_on_masked_features_drawn_after_the_anchors():
    """With feature_dropout > 0 a training step equals the drafter on features zeroed by the mask drawn
    from the row generators right after the anchors (anchors unchanged, resumable), and differs
    from the step without dropout."""
    drafter = tiny_drafter()
    rows, feats, argmax = batch()
    settings = StepSettings(num_anchors=6, gamma=2.0, position_weights="decay", feature_dropout=0.4,
                            feature_dropout_unit="position")  # decay: the block_loss written out below
    step = drafter_step(drafter, rows, feats, argmax, settings, gens(1, 2), train=True)
    again = drafter_step(drafter, rows, feats, argmax, settings, gens(1, 2), train=True)
    g = gens(1, 2)
    blocks = make_blocks(rows, argmax, drafter, settings, g)
    keep = feature_keep_mask(rows["position_ids"], 0.4, "position", g)
    assert 0 < (~keep).sum() < keep.numel()
    hidden = drafter(drop_features(feats, keep), rows["position_ids"], blocks.block_input_ids,
                     blocks.block_position_ids, make_masks(blocks, T, drafter, "dense"))
    manual = block_loss(hidden, drafter.lm_head_weight, blocks.labels, blocks.loss_weight, block_size=4,
                        slot_valid=blocks.slot_valid, loss_impl=settings.loss_impl)
    no_drop = drafter_step(drafter, rows, feats, argmax,
                           StepSettings(num_anchors=6, gamma=2.0, position_weights="decay"), gens(1, 2), train=True)
    for f in SUMS:
        assert torch.equal(getattr(step, f), getattr(manual, f)), f
        assert torch.equal(getattr(again, f), getattr(step, f)), f
    assert torch.equal(step.count, no_drop.count)  # same anchors, same valid slots
    assert not torch.equal(step.loss_sum, no_drop.loss_sum)


@pytest.mark.parametrize("position_weights,unit", [("decay", "document"), ("dpace", "position"), ("cat", "document")])
def test_step_sums_of_two_half_batches_equal_the_whole(position_weights, unit):
    """Two drafters with one row each (their own row generators) sum to the one-drafter step: anchors,
    feature dropout and the loss weights of a row depend on that row only."""
    drafter = tiny_drafter()
    rows, feats, argmax = batch()
    last = torch.randn(2, T, H, generator=torch.Generator().manual_seed(3))
    settings = StepSettings(num_anchors=6, gamma=2.0, position_weights=position_weights, feature_dropout=0.3,
                            feature_dropout_unit=unit)
    whole = drafter_step(drafter, rows, feats, argmax, settings, gens(1, 2), last, train=True)
    halves = [drafter_step(drafter, {k: v[i:i + 1] for k, v in rows.items()}, feats[i:i + 1], argmax[i:i + 1],
                           settings, gens(1 + i), last[i:i + 1], train=True) for i in range(2)]
    for f in ("loss_sum", "weight_sum"):
        torch.testing.assert_close(halves[0].__dict__[f] + halves[1].__dict__[f], whole.__dict__[f], rtol=1e-5, atol=0)
    for f in ("correct", "count", "run_length_sum", "num_blocks"):
        assert torch.equal(halves[0].__dict__[f] + halves[1].__dict__[f], whole.__dict__[f]), f


def test_step_requires_target_states_for_cat_weights():
    """CAT weights read the target's distribution: a step without its final states fails by name."""
    drafter = tiny_drafter()
    rows, feats, argmax = batch()
    with pytest.raises(ValueError, match="target_last_hidden"):
        drafter_step(drafter, rows, feats, argmax, StepSettings(num_anchors=6, gamma=2.0, position_weights="cat"),
                     gens(1, 2))
