"""Block loss sums and metric summaries on hand-worked examples and against plain recomputations.

Shapes: R rows, N anchors, B block size, Q = N·B, H hidden, V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trainer.drafter.loss import LossSums, block_loss
from dflash_trainer.drafter.metrics import MetricAccumulator

LN2 = math.log(2.0)


def hand_example():
    """V = H = 3 with an identity LM head, so the hidden state is the logits.

    Logit rows with one entry log 2 and two zeros: softmax (1/2, 1/4, 1/4), argmax at the log-2 entry,
    CE = ln 2 on that label and ln 4 on the others. B = 4, three blocks:
      block 0: labels (·, 0, 1, 2), argmax (·, 0, 1, 0) -> ✓ ✓ ✗, run 2, CE ln2, ln2, ln4
      block 1: labels (·, 1, 1, 1), argmax (·, 0, 1, 1) -> ✗ ✓ ✓, run 0, CE ln4, ln2, ln2
      block 2: labels (·, 2, 0, junk), argmax (·, 2, 0, ·), slot 3 invalid -> ✓ ✓, run 2, CE ln2, ln2
    weights (·, 1, 1/2, 1/4) on valid slots.
    loss_sum = (1·ln2 + ½ln2 + ¼·2ln2) + (1·2ln2 + ½ln2 + ¼ln2) + (1·ln2 + ½ln2) = 6.25 ln2
    weight_sum = 1.75 + 1.75 + 1.5 = 5; correct per slot (0, 2, 3, 1); count (0, 3, 3, 2); runs 2+0+2 = 4.
    Slot 0 holds NaN and the invalid slot huge logits and an out-of-range label: neither may matter.
    """
    def row(i):
        r = [0.0, 0.0, 0.0]
        r[i] = LN2
        return r

    nan = [float("nan")] * 3
    hidden = torch.tensor([[nan, row(0), row(1), row(0),
                            nan, row(0), row(1), row(1),
                            nan, row(2), row(0), [1e4, -1e4, 3.0]]], dtype=torch.float32)
    labels = torch.tensor([[-100, 0, 1, 2, 7777, 1, 1, 1, -5, 2, 0, 123456]])
    weight = torch.tensor([[0.0, 1, 0.5, 0.25, 0.0, 1, 0.5, 0.25, 0.0, 1, 0.5, 0.0]])
    return hidden, torch.eye(3), labels, weight


@pytest.mark.parametrize("chunk_size", [None, 3, 7])
def test_block_loss_hand_example(chunk_size):
    """Hand-worked sums: catches a label shift, slot 0 reaching the LM head, invalid slots counted,
    and the run length not stopping at the first miss."""
    hidden, head, labels, weight = hand_example()
    hidden.requires_grad_(True)
    s = block_loss(hidden, head, labels, weight, block_size=4, chunk_size=chunk_size)
    assert s.loss_sum.dtype == torch.float32
    assert s.loss_sum.item() == pytest.approx(6.25 * LN2, rel=1e-6)
    assert s.weight_sum.item() == pytest.approx(5.0)
    assert s.correct.tolist() == [0, 2, 3, 1]
    assert s.count.tolist() == [0, 3, 3, 2]
    assert s.run_length_sum.item() == 4
    assert s.num_blocks.item() == 3
    s.loss_sum.backward()
    g = hidden.grad
    assert torch.isfinite(g).all()
    assert g[0, [0, 4, 8]].abs().max() == 0 and g[0, 11].abs().max() == 0


def test_invalid_slots_and_slot0_do_not_matter():
    """Changing hidden states or labels at slot 0 and at invalid slots leaves every sum unchanged."""
    g = torch.Generator().manual_seed(0)
    r, n, b, h, v = 2, 5, 4, 6, 11
    hidden = torch.randn(r, n * b, h, generator=g)
    head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (r, n * b), generator=g)
    weight = torch.rand(r, n * b, generator=g) + 0.1
    weight[:, ::b] = 0.0
    weight[0, 6:8] = 0.0  # block 1 loses slots 2, 3
    weight[1, 12:16] = 0.0  # block 3 fully invalid (padded anchor)
    dead = weight == 0
    base = block_loss(hidden, head, labels, weight, block_size=b)
    hidden2 = torch.where(dead[..., None], torch.randn(r, n * b, h, generator=g) * 50, hidden)
    labels2 = torch.where(dead, torch.full_like(labels, -100), labels)
    other = block_loss(hidden2, head, labels2, weight, block_size=b)
    for f in ("loss_sum", "weight_sum", "correct", "count", "run_length_sum", "num_blocks"):
        torch.testing.assert_close(getattr(other, f), getattr(base, f), msg=f)
    assert base.num_blocks.item() == 2 * n - 1


def plain_ce_sums(hidden, head, labels, weight, b):
    """Obvious per-slot recomputation with Python loops."""
    r, q, _ = hidden.shape
    loss, wsum = torch.zeros(()), 0.0
    correct, count = [0] * b, [0] * b
    runs, blocks = 0, 0
    for ri in range(r):
        for j in range(q // b):
            running = True
            for k in range(1, b):
                i = j * b + k
                if weight[ri, i] <= 0:
                    running = False
                    continue
                logits = head @ hidden[ri, i]
                loss = loss + weight[ri, i] * (torch.logsumexp(logits, 0) - logits[labels[ri, i]])
                wsum += float(weight[ri, i])
                ok = int(logits.argmax()) == int(labels[ri, i])
                correct[k] += ok
                count[k] += 1
                if k == 1:
                    blocks += 1
                running = running and ok
                runs += running
    return loss, wsum, correct, count, runs, blocks


@pytest.mark.parametrize("chunk_size", [3, 7, 10, 100])
def test_chunked_equals_unchunked_and_plain(chunk_size):
    """Chunked LM head (recomputed in backward) gives the same sums and gradients as one chunk and
    as a plain loop: a chunk boundary must not drop, double or misalign blocks."""
    g = torch.Generator().manual_seed(1)
    r, n, b, h, v = 2, 5, 4, 6, 11
    hidden = torch.randn(r, n * b, h, generator=g)
    head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (r, n * b), generator=g)
    weight = torch.rand(r, n * b, generator=g)
    weight[:, ::b] = 0.0
    weight[1, 9] = 0.0
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    one = block_loss(h1, head, labels, weight, block_size=b)
    many = block_loss(h2, head, labels, weight, block_size=b, chunk_size=chunk_size)
    one.loss_sum.backward()
    many.loss_sum.backward()
    for f in ("loss_sum", "weight_sum", "correct", "count", "run_length_sum", "num_blocks"):
        torch.testing.assert_close(getattr(many, f), getattr(one, f), msg=f)
    torch.testing.assert_close(h2.grad, h1.grad)
    loss, wsum, correct, count, runs, blocks = plain_ce_sums(hidden, head, labels, weight, b)
    torch.testing.assert_close(one.loss_sum, loss.float())
    assert one.weight_sum.item() == pytest.approx(wsum, rel=1e-6)
    assert one.correct.tolist() == correct and one.count.tolist() == count
    assert one.run_length_sum.item() == runs and one.num_blocks.item() == blocks


def test_kl_matches_manual():
    """kind='kl' is Σ w · KL(target || drafter) with the LM head on both sides, slot 0 excluded."""
    g = torch.Generator().manual_seed(2)
    r, n, b, h, v = 1, 3, 4, 5, 7
    hidden = torch.randn(r, n * b, h, generator=g, requires_grad=True)
    target_hidden = torch.randn(r, n * b, h, generator=g)
    head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (r, n * b), generator=g)
    weight = torch.rand(r, n * b, generator=g)
    weight[:, ::b] = 0.0
    weight[0, 11] = 0.0
    s = block_loss(hidden, head, labels, weight, block_size=b, kind="kl", target_hidden=target_hidden, chunk_size=3)
    expected = 0.0
    for i in range(n * b):
        if weight[0, i] > 0:
            p = torch.softmax(head @ target_hidden[0, i], 0)
            q = torch.softmax(head @ hidden[0, i].detach(), 0)
            expected += float(weight[0, i]) * float((p * (p.log() - q.log())).sum())
    assert s.loss_sum.item() == pytest.approx(expected, rel=1e-5)
    s.loss_sum.backward()
    assert hidden.grad[0, ::b].abs().max() == 0 and hidden.grad.abs().sum() > 0
    # The drafter equal to the target gives zero KL.
    same = block_loss(target_hidden, head, labels, weight, block_size=b, kind="kl", target_hidden=target_hidden)
    assert abs(same.loss_sum.item()) < 1e-6


def test_block_loss_rejects_bad_inputs():
    """Misconfigured calls fail with a message instead of silently misaligning blocks."""
    hidden, head, labels, weight = hand_example()
    with pytest.raises(ValueError, match="block_size"):
        block_loss(hidden, head, labels, weight, block_size=5)
    with pytest.raises(ValueError, match="target_hidden"):
        block_loss(hidden, head, labels, weight, block_size=4, kind="kl")


def _sums(loss, w, correct, count, runs, blocks) -> LossSums:
    return LossSums(torch.tensor(loss), torch.tensor(w), torch.tensor(correct), torch.tensor(count),
                    torch.tensor(runs), torch.tensor(blocks))


def test_metrics_summary_tau():
    """τ on three blocks of B−1 = 3 slots with runs 2, 0, 3 (✓✓✗, ✗✓✓, ✓✓✓):
    exact τ = 1 + 5/3; acc = (2/3, 1, 2/3); estimate = 1 + 2/3 + 2/3 + 4/9 = 25/9. The estimate
    ignoring correlation is why both are reported."""
    acc = MetricAccumulator(4, "cpu")
    acc.add(_sums(3.0, 4.0, [0, 1, 2, 1], [0, 2, 2, 2], 2, 2))  # blocks 1 and 2 (runs 2, 0)
    acc.add(_sums(1.5, 2.0, [0, 1, 1, 1], [0, 1, 1, 1], 3, 1))  # block 3 (run 3)
    s = acc.summary()
    assert s["loss"] == pytest.approx(4.5 / 6.0)
    assert s["acc_per_position"] == pytest.approx([2 / 3, 1.0, 2 / 3])
    assert s["tau_exact"] == pytest.approx(1 + 5 / 3)
    assert s["tau_estimate"] == pytest.approx(25 / 9)
    assert s["valid_slots"] == 9 and s["num_blocks"] == 3
    empty = acc.summary()  # summary resets
    assert empty["loss"] is None and empty["tau_exact"] is None and empty["tau_estimate"] is None
    assert empty["acc_per_position"] == [None, None, None] and empty["valid_slots"] == 0


def test_metrics_missing_position_is_none():
    """A slot position with no valid slots reports None (not NaN) and counts as 0 in the estimate."""
    acc = MetricAccumulator(4, "cpu")
    acc.add(_sums(1.0, 2.0, [0, 1, 1, 0], [0, 2, 1, 0], 1, 2))
    s = acc.summary()
    assert s["acc_per_position"][:2] == pytest.approx([0.5, 1.0])
    assert s["acc_per_position"][2] is None
    assert s["tau_estimate"] == pytest.approx(1 + 0.5 + 0.5)
    assert s["tau_exact"] == pytest.approx(1.5)


def test_loss_to_metrics_end_to_end():
    """block_loss sums fed to the accumulator: hand example gives loss 6.25 ln2 / 5 and τ = 1 + 4/3."""
    hidden, head, labels, weight = hand_example()
    acc = MetricAccumulator(4, "cpu")
    acc.add(block_loss(hidden, head, labels, weight, block_size=4))
    s = acc.summary()
    assert s["loss"] == pytest.approx(6.25 * LN2 / 5, rel=1e-6)
    assert s["tau_exact"] == pytest.approx(1 + 4 / 3)
    assert s["acc_per_position"] == pytest.approx([2 / 3, 1.0, 0.5])
    assert s["tau_estimate"] == pytest.approx(1 + 2 / 3 + 2 / 3 + 1 / 3)
