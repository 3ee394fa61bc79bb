"""GPU-only: every loss option through the compiled LM-head chunk equals the eager one (the
no-host-sync check of a step with the options is in test_sync_free_step.py).

Shapes: R rows, Q = N·B block queries, H hidden, V vocabulary.
"""

import itertools

import pytest
import torch

from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.weights import decay_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

R, N, H, V = 2, 24, 64, 1000


def _chunk_inputs(seed: int, b: int, gamma: float) -> tuple[torch.Tensor, ...]:
    """Random LM-head chunk inputs on CUDA at block size b: hidden and target_hidden [R,N·b,H], head [V,H],
    labels [R,N·b], valid [R,N·b] (~15 % invalid, anchors invalid) and decay weights (γ) on the valid slots,
    then the generator for further draws."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(R, N * b, H, device=dev, generator=g)
    target_hidden = torch.randn(R, N * b, H, device=dev, generator=g)
    head = torch.randn(V, H, device=dev, generator=g) / 8
    labels = torch.randint(0, V, (R, N * b), device=dev, generator=g)
    valid = torch.rand(R, N * b, device=dev, generator=g) > 0.15
    valid[:, ::b] = False
    weight = torch.where(valid, decay_weights(b, gamma, dev)[torch.arange(N * b, device=dev) % b], 0.0)
    return hidden, target_hidden, head, labels, valid, weight, g


@pytest.mark.parametrize("kind,position_weights", list(itertools.product(("ce", "kl", "ce_kl"), ("decay", "dpace", "cat"))))
def test_compiled_chunk_equals_eager(kind, position_weights):
    """torch.compile of the chunk (one graph per option set) gives the eager sums and gradients up to
    fusion rounding: catches an option the compiled graph drops or bakes in wrongly."""
    b = 8
    hidden, target_hidden, head, labels, valid, weight, _ = _chunk_inputs(0, b, 4.0)
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


@pytest.mark.parametrize("loss_impl", ["autograd", "fused"])
def test_compiled_chunk_with_a_block_scale_equals_eager(loss_impl):
    """A per-block scale (experimental.rejection_weight's [R,N] factor) through the compiled chunk gives the
    eager sums and gradients, and scaling about 30 % of the blocks by 4 moves the sums (the scale is not
    dropped)."""
    b = 16
    hidden, _, head, labels, valid, weight, g = _chunk_inputs(2, b, 7.0)
    scale = 1.0 + 3.0 * (torch.rand(R, N, device=g.device, generator=g) > 0.7).float()
    out = {}
    for compiled, sc in ((False, scale), (True, scale), (True, None)):
        hid = hidden.clone().requires_grad_(True)
        s = block_loss(hid, head, labels, weight, block_size=b, kind="ce", slot_valid=valid, chunk_size=70,
                       compiled=compiled, position_weights="dpace", loss_impl=loss_impl, block_scale=sc)
        s.loss_sum.backward()
        out[compiled, sc is None] = (s, hid.grad)
    (e, ge), (c, gc), (u, _) = out[False, False], out[True, False], out[True, True]
    torch.testing.assert_close(c.loss_sum, e.loss_sum, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c.weight_sum, e.weight_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gc, ge, rtol=1e-3, atol=1e-5)
    assert c.weight_sum.item() > u.weight_sum.item() * 1.2
