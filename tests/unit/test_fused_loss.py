"""loss_impl "fused" (drafter/fused_loss.py: ∂loss/∂hidden computed in the forward pass) against the
autograd path: the same sums and the same gradient for every loss option, chunked or not, with
invalid slots and an upstream scale; the drafter step's optimizer update; the setting's plumbing.

Shapes: R rows, N anchors, B block size, Q = N·B, H hidden, V vocabulary (random_case: 2, 5, 5, 6, 13).
"""

from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest
import torch

from dflash_trainer.drafter.loss import block_loss
from test_loss_options import random_case

KINDS = ("ce", "kl", "ce_kl")
WEIGHTS = ("decay", "dpace", "cat")
TRANSFORMS = ((1.0, None), (0.7, None), (1.3, 2.5))  # (logit_scale, logit_softcap): none, Granite-like, Gemma-like
B = 5


def case64(seed: int):
    """random_case in float64 (hidden, target hidden, LM head, decay weights); labels −100 on invalid slots."""
    return [x.double() if x.is_floating_point() else x for x in random_case(seed)]


def run(impl: str, hidden, target_hidden, head, labels, valid, loss_weight, *, scale_by=7.0, **kw):
    """block_loss with `impl`; returns (sums, ∂(loss_sum / scale_by)/∂hidden)."""
    hid = hidden.clone().requires_grad_(True)
    s = block_loss(hid, head, labels, loss_weight, block_size=B, target_hidden=target_hidden, slot_valid=valid,
                   loss_impl=impl, **kw)
    (grad,) = torch.autograd.grad(s.loss_sum / scale_by, hid)
    return s, grad


def assert_same_sums(a, f):
    torch.testing.assert_close(f.loss_sum, a.loss_sum, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f.weight_sum, a.weight_sum, rtol=1e-6, atol=0)  # fp32 weights on both paths
    for name in ("correct", "count", "run_length_sum", "num_blocks"):
        assert torch.equal(getattr(f, name), getattr(a, name)), name


@pytest.mark.parametrize("kind,position_weights,chunk,transform",
                         list(itertools.product(KINDS, WEIGHTS, (None, 13), TRANSFORMS)))
def test_fused_equals_autograd(kind, position_weights, chunk, transform):
    """Every loss × weights × logit transform, one chunk and chunks of 3 blocks (13 slots // 4; the last
    chunk holds 1 block), invalid slots (a hole, a block's tail, a whole block), the gradient of
    loss_sum / 7: sums and ∂/∂hidden equal the autograd path's in float64. Catches a wrong closed-form
    term (p_T, one-hot, the soft-cap chain), a D-PACE / CAT weight treated as differentiable on one
    path only, an invalid slot leaking gradient, a chunk written to the wrong rows."""
    scale, softcap = transform
    kw = dict(kind=kind, position_weights=position_weights, chunk_size=chunk, dpace_alpha=0.3, ce_weight=0.25,
              kl_weight=0.75, logit_scale=scale, logit_softcap=softcap)
    args = case64(1)
    a, ga = run("autograd", *args, **kw)
    f, gf = run("fused", *args, **kw)
    assert_same_sums(a, f)
    torch.testing.assert_close(gf, ga, rtol=1e-10, atol=1e-13)
    assert ga.abs().max() > 0
    valid = args[4]
    assert gf[~valid].abs().max() == 0  # slot 0 and the invalid slots get no gradient


@pytest.mark.parametrize("denominator", ("blocks", "weights"))
def test_fused_dpace_denominators_and_the_training_loss(denominator):
    """The step's own objective, loss_sum / weight_sum (a tensor denominator, as train_step divides),
    backpropagated with .backward(): the same hidden.grad with either D-PACE denominator."""
    hidden, target_hidden, head, labels, valid, loss_weight = case64(2)
    grads = {}
    for impl in ("autograd", "fused"):
        hid = hidden.clone().requires_grad_(True)
        s = block_loss(hid, head, labels, loss_weight, block_size=B, slot_valid=valid, position_weights="dpace",
                       dpace_denominator=denominator, chunk_size=9, loss_impl=impl)
        (s.loss_sum / s.weight_sum).backward()
        grads[impl] = (s, hid.grad)
    assert_same_sums(grads["autograd"][0], grads["fused"][0])
    torch.testing.assert_close(grads["fused"][1], grads["autograd"][1], rtol=1e-10, atol=1e-13)


def test_fused_float32_and_rows_split():
    """fp32 inputs (the CPU training dtype): same gradient up to fp32 rounding; and each row's fused
    sums and gradient do not depend on the other rows (data-parallel invariance, as for autograd)."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(3)
    kw = dict(kind="ce_kl", position_weights="cat", chunk_size=6)
    a, ga = run("autograd", hidden, target_hidden, head, labels, valid, loss_weight, **kw)
    f, gf = run("fused", hidden, target_hidden, head, labels, valid, loss_weight, **kw)
    torch.testing.assert_close(f.loss_sum, a.loss_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gf, ga, rtol=1e-4, atol=1e-6)
    parts = [run("fused", hidden[i:i + 1], target_hidden[i:i + 1], head, labels[i:i + 1], valid[i:i + 1],
                 loss_weight[i:i + 1], **kw) for i in range(2)]
    torch.testing.assert_close(parts[0][0].loss_sum + parts[1][0].loss_sum, f.loss_sum, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), gf, rtol=1e-5, atol=1e-7)


def test_fused_keeps_no_vocabulary_sized_tensor_for_backward():
    """What the fused path saves for backward is ∂/∂hidden only (hidden's size), never [·,V] logits:
    with V ≫ H the largest saved tensor of the autograd path (unchunked) is a [slots,V] one."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(4)
    saved = {}
    for impl in ("autograd", "fused"):
        sizes = []
        hid = hidden.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            s = block_loss(hid, head, labels, loss_weight, block_size=B, slot_valid=valid, kind="kl",
                           target_hidden=target_hidden, loss_impl=impl)
        s.loss_sum.backward()
        saved[impl] = max(sizes)
    assert saved["fused"] == hidden.numel()
    assert saved["autograd"] >= 2 * 5 * (B - 1) * 13  # [R·N·(B−1), V] logits


def test_fused_without_gradient_is_the_autograd_forward():
    """Validation (no_grad) and a hidden without requires_grad need no gradient: both impls give the
    same sums and nothing is kept."""
    args = case64(5)
    hidden, target_hidden, head, labels, valid, loss_weight = args
    kw = dict(block_size=B, slot_valid=valid, kind="ce_kl", target_hidden=target_hidden, position_weights="dpace",
              chunk_size=7)
    with torch.no_grad():
        a = block_loss(hidden.requires_grad_(True), head, labels, loss_weight, loss_impl="autograd", **kw)
        f = block_loss(hidden, head, labels, loss_weight, loss_impl="fused", **kw)
    assert_same_sums(a, f)
    assert not f.loss_sum.requires_grad
    f = block_loss(hidden.detach(), head, labels, loss_weight, loss_impl="fused", **kw)
    assert_same_sums(a, f)


def test_fused_refuses_a_trainable_head_and_unknown_impl():
    """The fused path computes no LM-head gradient: a head that wants one is refused, naming the setting."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(6)
    with pytest.raises(ValueError, match="loss_impl='fused'.*lm_head_weight"):
        block_loss(hidden.requires_grad_(True), head.clone().requires_grad_(True), labels, loss_weight,
                   block_size=B, slot_valid=valid, loss_impl="fused")
    with pytest.raises(ValueError, match="loss_impl"):
        block_loss(hidden, head, labels, loss_weight, block_size=B, slot_valid=valid, loss_impl="liger")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile needs a C compiler")
def test_compiled_fused_equals_eager_fused_on_cpu():
    """The compiled elementwise pass (one graph, gradient written into the logits buffer in place)
    gives the eager pass's sums and gradient: ce_kl + CAT + soft-cap, chunked (two chunk shapes)."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(7)
    kw = dict(kind="ce_kl", position_weights="cat", chunk_size=13, logit_scale=0.8, logit_softcap=3.0)
    e, ge = run("fused", hidden, target_hidden, head, labels, valid, loss_weight, compiled=False, **kw)
    c, gc = run("fused", hidden, target_hidden, head, labels, valid, loss_weight, compiled=True, **kw)
    torch.testing.assert_close(c.loss_sum, e.loss_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.weight_sum, e.weight_sum, rtol=1e-5, atol=1e-6)
    assert torch.equal(c.correct, e.correct)
    torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-6)


def tiny_drafter(softcap: float | None):
    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.model import DFlashDrafter

    V, H = 64, 32
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=V, block_size=4, mask_token_id=V - 1,
                        target_layer_ids=[0, 1], num_target_layers=2,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                        logit_scale=0.9 if softcap else 1.0, logit_softcap=softcap)
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.mul_(3.0)  # peaked distributions: the soft-cap bends them
    return DFlashDrafter(cfg, emb, head)


@pytest.mark.parametrize("options,softcap", [
    ({}, None),  # training's default objective (CE, D-PACE), one chunk
    (dict(loss="ce_kl", position_weights="cat", loss_chunk=9), 4.0),
    (dict(loss="kl", position_weights="decay", loss_chunk=5), None),
])
def test_one_optimizer_step_is_the_same_with_either_impl(options, softcap, one_thread):
    """End to end through training.loop.train_step (anchors, blocks, masks, drafter, loss, the global
    division, backward, clip, AdamW) on a tiny fp32 drafter: the same metric sums, the same
    gradients reaching the optimizer (clip off, so their scale 1 / Σ w is compared too: Adam's first
    step alone is scale-invariant), and the same weights after the step (1e-6).
    lr 5e-5: Adam's first update is lr·g/(|g|+ε), so a weight whose gradient is near ε = 1e-8 moves
    by a fraction of lr that fp32 rounding of g can change (seen: 3e-6 at lr 1e-3, 4e-7 at 1e-4); a
    sign error in a gradient still moves a weight by 1e-4."""
    from dflash_trainer.drafter.metrics import MetricAccumulator
    from dflash_trainer.training.loop import Batch, row_generators, train_step
    from dflash_trainer.training.optim import build_optimizer
    from dflash_trainer.training.step import StepSettings

    T = 24
    g = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(12), torch.arange(12)])[None]
    rows = {"input_ids": torch.randint(0, 63, (1, T), generator=g), "position_ids": pos, "loss_mask": pos >= 3}
    feats = torch.randn(1, T, 2 * 32, generator=g)
    argmax = torch.randint(0, 63, (1, T), generator=g)
    last_hidden = torch.randn(1, T, 32, generator=g)
    after, sums, grads = {}, {}, {}
    for impl in ("autograd", "fused"):
        drafter = tiny_drafter(softcap)
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = build_optimizer(params, lr=5e-5, weight_decay=0.0)
        grads[impl] = [None] * len(params)
        for i, p in enumerate(params):  # each gradient as backward leaves it, before the update
            p.register_post_accumulate_grad_hook(lambda p, _i=i, _g=grads[impl]: _g.__setitem__(_i, p.grad.clone()))
        settings = StepSettings(num_anchors=6, gamma=2.0, loss_impl=impl, **options)
        batch = Batch(0, np.arange(1, dtype=np.int64), rows, feats, argmax, last_hidden)
        acc = MetricAccumulator(4, torch.device("cpu"))
        finite = train_step(drafter, batch, settings, row_generators(batch.row_index, 0, 0, 0, torch.device("cpu")),
                            opt, params, 1e6, acc)
        assert bool(finite)
        after[impl] = [p.detach().clone() for p in params]
        sums[impl] = acc.state()  # loss and weight sums, accuracy counts of the step
    torch.testing.assert_close(sums["fused"], sums["autograd"], rtol=1e-6, atol=1e-6)
    for ga, gf in zip(grads["autograd"], grads["fused"]):
        torch.testing.assert_close(gf, ga, rtol=1e-4, atol=1e-5 * float(ga.abs().max()))
    assert all(gr.abs().max() > 0 for gr in grads["fused"])
    before = [p.detach() for p in tiny_drafter(softcap).parameters() if p.requires_grad]
    assert any(not torch.equal(b, p) for b, p in zip(before, after["fused"]))  # the step changed the weights
    for pa, pf in zip(after["autograd"], after["fused"]):
        torch.testing.assert_close(pf, pa, rtol=0, atol=1e-6)


def test_loss_impl_setting_reaches_the_step_and_bench():
    """loss_impl: config field (default fused, bad values refused naming it), carried by
    run.step_settings into StepSettings, chosen by bench step's rig, and changeable on resume
    (same math, like `compile`)."""
    from pathlib import Path

    from dflash_trainer.bench.common import BenchShape
    from dflash_trainer.bench.step_rig import rig_from_shape
    from dflash_trainer.config.schema import TrainConfig, saved_config
    from dflash_trainer.config.load import load_config
    from dflash_trainer.training.checkpoint import check_resume_config
    from dflash_trainer.training.run import step_settings
    from dflash_trainer.training.step import StepSettings

    assert TrainConfig().experimental.loss_impl == "fused" == StepSettings(num_anchors=1, gamma=1.0).loss_impl
    with pytest.raises(ValueError, match="loss_impl"):
        load_config(sets=["loss_impl=liger"])
    cfg = load_config(sets=["loss_impl=autograd"])
    shape = BenchShape(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       vocab_size=128, num_target_layers=6, num_target_features=2, seq_len=256, num_documents=2,
                       num_anchors=16, block_size=8, layer_types="full")
    assert step_settings(cfg, shape.drafter_config(), torch.device("cpu")).loss_impl == "autograd"
    cpu = torch.device("cpu")
    assert rig_from_shape(shape, cpu, loss_impl="autograd").settings.loss_impl == "autograd"
    assert rig_from_shape(shape, cpu).settings.loss_impl == "fused"
    check_resume_config(saved_config(TrainConfig()), cfg.model_dump(), Path("ck"))
