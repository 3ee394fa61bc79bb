"""drafter/rejection.py and `experimental.rejection_weight`: which blocks are tagged (hand-worked), the
drafts against a brute-force argmax, the block scale in block_loss against per-block sums (every weight
option, autograd and fused), and the training step: off by default and outside training, on with λ > 0.

Shapes: R rows, N anchors, B block size, S = B−1 trained slots, H hidden, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.rejection import block_correct, rejection_scale
from dflash_trainer.training.step import StepSettings, drafter_step, make_blocks
from tests.unit.test_feature_dropout import SUMS, batch, gens, tiny_drafter

T_, F_ = True, False


def test_tagged_blocks_hand_worked():
    """B = 4 (S = 3), λ = 2. Row 0, anchors 2, 5, 9, 12, 20 (the last one invalid):
    block@2 drafts ✓✓✗ → run 2, rejects at 2+2+1 = 5: the block at 5 is tagged;
    block@5 ✗ → rejects at 6 (no anchor there); block@9 ✓✗✓ → rejects at 11 (none);
    block@12 ✓✓✓ → accepts all, rejects nowhere; block@20 invalid: neither.
    Row 1, the same anchors: block@2 ✓✓ then an invalid slot (its document ends) → rejects nowhere, so
    nothing of row 1 is tagged, and row 0's rejection at 5 does not tag row 1's block at 5; block@9 ✗ →
    rejects at 10 (none); block@5 ✓✓✗ → 8 (none); block@12 ✗ → 13 (none)."""
    anchors = torch.tensor([[2, 5, 9, 12, 20], [2, 5, 9, 12, 20]])
    anchor_valid = torch.tensor([[T_, T_, T_, T_, F_], [T_, T_, T_, T_, F_]])
    correct = torch.tensor([[T_, T_, F_], [F_, F_, F_], [T_, F_, T_], [T_, T_, T_], [F_, F_, F_],
                            [T_, T_, F_], [T_, T_, F_], [F_, F_, F_], [F_, T_, T_], [F_, F_, F_]])
    valid = torch.ones(10, 3, dtype=torch.bool)
    valid[4] = False  # the invalid anchor's slots
    valid[5, 2] = False  # row 1, block@2: slot 3 past its document's end
    valid[9] = False
    correct = correct & valid
    scale = rejection_scale(correct, valid, anchors, anchor_valid, seq_len=24, weight=2.0)
    assert scale.tolist() == [[1.0, 3.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
    assert torch.equal(rejection_scale(correct, valid, anchors, anchor_valid, 24, 0.0), torch.ones(2, 5))
    with pytest.raises(ValueError, match="rejection_weight=-1"):
        rejection_scale(correct, valid, anchors, anchor_valid, 24, -1.0)


def test_a_rejection_at_the_row_end_is_dropped():
    """A rejection position at T (past the row's last position; block@6's slot 3 with T = 9) tags nothing and
    does not index past the row."""
    anchors = torch.tensor([[1, 6]])
    correct = torch.tensor([[T_, F_, F_], [T_, T_, F_]])  # block@6 rejects at 9 = T (nothing there); block@1 at 3
    valid = torch.ones(2, 3, dtype=torch.bool)
    assert rejection_scale(correct, valid, anchors, torch.ones(1, 2, dtype=torch.bool), 9, 1.0).tolist() == [[1.0, 1.0]]


def test_block_correct_equals_a_brute_force_argmax():
    g = torch.Generator().manual_seed(0)
    R, N, B, H, V = 2, 3, 4, 8, 11
    hidden = torch.randn(R, N * B, H, generator=g)
    W = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (R, N * B), generator=g)
    logits = hidden @ W.T
    labels[0, 1] = logits[0, 1].argmax()  # a few right drafts
    labels[1, 6] = logits[1, 6].argmax()
    valid = torch.rand(R, N * B, generator=g) > 0.2
    valid[:, ::B] = False
    want = torch.zeros(R * N, B - 1, dtype=torch.bool)
    for r in range(R):
        for j in range(N):
            for k in range(1, B):
                q = j * B + k
                want[r * N + j, k - 1] = bool(valid[r, q]) and int(logits[r, q].argmax()) == int(labels[r, q])
    for chunk in (None, 3, 7):
        assert torch.equal(block_correct(hidden, W, labels, valid, B, chunk), want), chunk
    assert want.any()


@pytest.mark.parametrize("loss_impl", ["autograd", "fused"])
@pytest.mark.parametrize("position_weights,denominator", [("decay", "blocks"), ("dpace", "blocks"),
                                                          ("dpace", "weights"), ("cat", "blocks")])
def test_block_scale_equals_scaled_per_block_sums(position_weights, denominator, loss_impl):
    """loss_sum, weight_sum and the hidden's gradient with a block scale equal Σ_b scale_b × the sums of
    block b evaluated alone (every weight option's weights are per block), and the scale None equals
    all ones."""
    g = torch.Generator().manual_seed(1)
    R, N, B, H, V = 1, 4, 4, 8, 13
    W = torch.randn(V, H, generator=g)
    hidden = torch.randn(R, N * B, H, generator=g, dtype=torch.float64).requires_grad_(True)
    target_hidden = torch.randn(R, N * B, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (R, N * B), generator=g)
    weight = torch.rand(R, N * B, generator=g) + 0.1
    weight[:, ::B] = 0
    weight[0, 7] = 0  # an invalid slot
    scale = torch.tensor([[1.0, 3.0, 0.5, 2.0]])
    kw = dict(block_size=B, kind="ce", target_hidden=target_hidden, position_weights=position_weights,
              dpace_denominator=denominator, loss_impl=loss_impl)
    W = W.double()
    got = block_loss(hidden, W, labels, weight, block_scale=scale, **kw)
    (grad,) = torch.autograd.grad(got.loss_sum, hidden)
    want_loss = want_weight = 0.0
    want_grad = torch.zeros_like(hidden)
    for b in range(N):
        sl = slice(b * B, (b + 1) * B)
        h_b = hidden[:, sl].detach().clone().requires_grad_(True)
        one = block_loss(h_b, W, labels[:, sl], weight[:, sl], **{**kw, "target_hidden": target_hidden[:, sl]})
        (g_b,) = torch.autograd.grad(one.loss_sum, h_b)
        want_loss += scale[0, b].item() * one.loss_sum.item()
        want_weight += scale[0, b].item() * one.weight_sum.item()
        want_grad[:, sl] = scale[0, b].item() * g_b
    assert got.loss_sum.item() == pytest.approx(want_loss, rel=1e-6)  # the weights are fp32
    assert got.weight_sum.item() == pytest.approx(want_weight, rel=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
    plain = block_loss(hidden, W, labels, weight, **kw)
    ones = block_loss(hidden, W, labels, weight, block_scale=torch.ones(1, N), **kw)
    for f in SUMS:
        assert torch.equal(getattr(plain, f), getattr(ones, f)), f


def test_step_off_by_default_and_outside_training_on_with_a_weight():
    """rejection_weight = 0 (the default) and any weight at validation leave the step's sums as they
    were; in training a weight > 0 scales the tagged blocks: the step's weight_sum equals the decay
    weights times the scale computed from the same drafts."""
    drafter = tiny_drafter()
    rows, feats, argmax = batch()
    plain = StepSettings(num_anchors=16, gamma=2.0, position_weights="decay")
    on = StepSettings(num_anchors=16, gamma=2.0, position_weights="decay", rejection_weight=2.0)
    base = drafter_step(drafter, rows, feats, argmax, plain, gens(1, 2), train=True)
    val = drafter_step(drafter, rows, feats, argmax, on, gens(1, 2), train=False)
    for f in SUMS:
        assert torch.equal(getattr(base, f), getattr(val, f)), f
    got = drafter_step(drafter, rows, feats, argmax, on, gens(1, 2), train=True)
    blocks = make_blocks(rows, argmax, drafter, plain, gens(1, 2))  # the same anchors
    from dflash_trainer.training.step import make_masks
    hidden = drafter(feats, rows["position_ids"], blocks.block_input_ids, blocks.block_position_ids,
                     make_masks(blocks, feats.shape[1], drafter, "dense"))
    correct = block_correct(hidden, drafter.lm_head_weight, blocks.labels, blocks.slot_valid, 4)
    scale = rejection_scale(correct, blocks.slot_valid.reshape(-1, 4)[:, 1:], blocks.anchors, blocks.anchor_valid,
                            feats.shape[1], 2.0)
    assert (scale > 1).any(), "no block tagged: the case does not exercise the weight"
    w = blocks.loss_weight.reshape(-1, 4)[:, 1:] * scale.reshape(-1, 1)
    assert got.weight_sum.item() == pytest.approx(w.sum().item(), rel=1e-6)
    assert got.weight_sum > base.weight_sum
    assert torch.equal(got.correct, base.correct) and torch.equal(got.count, base.count)
