"""GPU-only: the steady-state drafter step makes no host synchronization.

Runs the real step (anchors, blocks, BlockMask build, compiled flex forward + backward, loss,
clip and AdamW: training.optim.clipped_step) at a small Qwen3-like shape under `torch.cuda.set_sync_debug_mode("error")`,
with CE and the decay weights and with the loss options (D-PACE / CAT weights, ce_kl, feature dropout,
loss_impl fused, rejection_weight).
"""

import pytest
import torch

from dflash_trainer.bench.common import BenchShape, synthetic_rows
from dflash_trainer.drafter.config import default_gamma
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.training.optim import build_optimizer, clipped_step
from dflash_trainer.training.step import StepSettings, drafter_step

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [
    {},
    dict(position_weights="dpace", feature_dropout=0.1, feature_dropout_unit="position"),
    dict(loss="ce_kl", position_weights="cat", feature_dropout=0.1),
    dict(position_weights="dpace", loss_impl="fused"),  # ∂loss/∂hidden in the forward pass (drafter/fused_loss.py)
    dict(loss="ce_kl", position_weights="cat", loss_impl="fused"),
    dict(position_weights="dpace", loss_impl="fused", rejection_weight=3.0),  # drafter/rejection.py's extra pass
], ids=["ce-decay", "dpace-dropout", "ce_kl-cat-dropout", "dpace-fused", "ce_kl-cat-fused", "dpace-fused-rejection"])
def test_steady_state_step_has_no_host_sync(options):
    """Prevents the GPU idling on the CPU: any .item(), nonzero, bool indexing or pageable copy in the
    step (a loss option's weights or the feature dropout included) raises."""
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
    last = torch.randn(1, shape.seq_len, cfg.hidden_size, device=dev, generator=g) if options else None
    extra = dict(compiled_loss=True, loss_chunk=256, **options) if options else {}
    settings = StepSettings(num_anchors=shape.num_anchors, gamma=default_gamma(16), mask_kind="flex",
                            **{"position_weights": "decay", **extra})  # {}: DFlash's decay weights
    before = [p.detach().clone() for p in params]

    def step():
        gens = [torch.Generator(device=dev).manual_seed(1)] if options else g
        with torch.autocast("cuda", dtype=torch.bfloat16):
            sums = drafter_step(drafter, rows, feats, argmax, settings, gens, last, train=True)
        (sums.loss_sum / sums.weight_sum.clamp_min(1e-6 if options else 1.0)).backward()
        clipped_step(opt, params, 1.0, torch.isfinite(sums.loss_sum))  # the compiled clip + AdamW update
        opt.zero_grad(set_to_none=True)
        return sums

    for _ in range(3):  # compile and allocate outside the checked region
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            sums = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(sums.loss_sum).item()
    assert sums.weight_sum.item() > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, params))
