"""GPU-only: every loss option through the compiled LM-head chunk equals the eager one, and a
training step with D-PACE / CAT / ce_kl and feature dropout makes no host synchronization.

Shapes: R rows, Q = N·B block queries, H hidden, V vocabulary.
"""

import itertools

import pytest
import torch

from dflash_trainer.bench.common import BenchShape, synthetic_rows
from dflash_trainer.drafter.config import default_gamma
from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.weights import decay_weights
from dflash_trainer.training.optim import build_optimizer
from dflash_trainer.training.step import StepSettings, drafter_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind,position_weights", list(itertools.product(("ce", "kl", "ce_kl"), ("decay", "dpace", "cat"))))
def test_compiled_chunk_equals_eager(kind, position_weights):
    """torch.compile of the chunk (one graph per option set) gives the eager sums and gradients up to
    fusion rounding: catches an option the compiled graph drops or bakes in wrongly."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    r, n, b, h, v = 2, 24, 8, 64, 1000
    hidden = torch.randn(r, n * b, h, device=dev, generator=g)
    target_hidden = torch.randn(r, n * b, h, device=dev, generator=g)
    head = torch.randn(v, h, device=dev, generator=g) / 8
    labels = torch.randint(0, v, (r, n * b), device=dev, generator=g)
    valid = torch.rand(r, n * b, device=dev, generator=g) > 0.15
    valid[:, ::b] = False
    weight = torch.where(valid, decay_weights(b, 4.0, dev)[torch.arange(n * b, device=dev) % b], 0.0)
    out = {}
    for compiled in (False, True):
        hid = hidden.clone().requires_grad_(True)
        s = block_loss(hid, head, labels, weight, block_size=b, kind=kind, target_hidden=target_hidden,
                       slot_valid=valid, chunk_size=70, compiled=compiled, position_weights=position_weights)
        s.loss_sum.backward()
        out[compiled] = (s, hid.grad)
    (e, ge), (c, gc) = out[False], out[True]
    torch.testing.assert_close(c.loss_sum, e.loss_sum, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c.weight_sum, e.weight_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gc, ge, rtol=1e-3, atol=1e-5)
    assert torch.equal(c.count, e.count)


@pytest.mark.parametrize("options", [
    dict(position_weights="dpace", feature_dropout=0.1, feature_dropout_unit="position"),
    dict(loss="ce_kl", position_weights="cat", feature_dropout=0.1),
])
def test_step_with_options_has_no_host_sync(options):
    """Prevents a loss option from idling the GPU on the CPU (an .item(), nonzero or boolean index in
    the weights or the dropout raises under sync debug mode)."""
    dev = torch.device("cuda")
    shape = BenchShape(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                       vocab_size=4096, num_target_layers=8, num_target_features=3, seq_len=1024, num_documents=4,
                       num_anchors=64, block_size=16, layer_types="last-full", sliding_window=256)
    cfg = shape.drafter_config()
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=dev).requires_grad_(False)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=dev).requires_grad_(False)
    drafter = DFlashDrafter(cfg, emb, head).to(dev)
    drafter.compile_layers()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr=1e-4, weight_decay=0.0)
    rows = synthetic_rows(shape, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    feats = torch.randn(1, shape.seq_len, cfg.num_aux_layers * cfg.hidden_size, device=dev, generator=g)
    argmax = torch.randint(0, cfg.vocab_size, (1, shape.seq_len), device=dev, generator=g)
    last = torch.randn(1, shape.seq_len, cfg.hidden_size, device=dev, generator=g)
    settings = StepSettings(num_anchors=shape.num_anchors, gamma=default_gamma(16), mask_kind="flex",
                            compiled_loss=True, loss_chunk=256, **options)

    def step():
        gens = [torch.Generator(device=dev).manual_seed(1)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            sums = drafter_step(drafter, rows, feats, argmax, settings, gens, last, train=True)
        (sums.loss_sum / sums.weight_sum.clamp_min(1e-6)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sums

    for _ in range(3):  # compile and allocate outside the checked region
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            sums = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(sums.loss_sum).item() and sums.weight_sum.item() > 0
