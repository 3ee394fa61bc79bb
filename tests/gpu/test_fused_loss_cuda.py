"""GPU-only: loss_impl "fused" (drafter/fused_loss.py) against "autograd", both compiled, bf16 under the
step's autocast, at SmolLM2-like shapes: 4,096 trained slots (1 row × 512 blocks × 8 slots, B = 9),
V = 49,152, H = 576.

Tolerances (bf16 has 8 significant bits, one rounding ≤ 2⁻⁹ ≈ 0.2 % relative):
  - loss_sum, weight_sum: both paths run the same bf16 LM-head matmul and then fp32 math in two
    different compiled graphs (different reduction orders): rtol 1e-4.
  - ∂/∂hidden (bf16): the paths round differently (autograd casts ∂/∂logits × the upstream scale to
    bf16 before the [·,V]×[V,H] matmul; fused casts ∂/∂logits, then scales the bf16 result), so
    elements differ by a few bf16 roundings: elementwise torch's bf16 rtol 1.6e-2 with atol 1 % of the
    largest |gradient|, and, the real check, each path's relative error (Frobenius) against an fp32
    autograd reference: fused ≤ 2 × autograd's + 1e-3. A wrong closed form or a dropped weight
    errs by O(1), far above both.
Peak memory (forward + backward, above what is allocated before): fused ≤ autograd (the fused chunk
holds one [slots,V] bf16 buffer, logits then gradient in place; autograd keeps the logits for
backward and allocates their gradient beside them).
"""

import pytest
import torch

from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.weights import decay_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

R, N, B, H, V = 1, 512, 9, 576, 49152


def inputs():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(R, N * B, H, device=dev, generator=g).bfloat16()  # final-normed: unit RMS
    target_hidden = (hidden.float() + 0.5 * torch.randn(R, N * B, H, device=dev, generator=g)).bfloat16()
    head = (0.1 * torch.randn(V, H, device=dev, generator=g)).bfloat16()  # logits of std ≈ 2.4
    labels = (target_hidden.float() @ head.float().T).argmax(-1)  # the target's greedy token ...
    noise = torch.randint(0, V, labels.shape, device=dev, generator=g)
    labels = torch.where(torch.rand(labels.shape, device=dev, generator=g) < 0.3, noise, labels)  # ... mostly
    valid = torch.rand(R, N * B, device=dev, generator=g) > 0.1
    valid[:, ::B] = False
    k = torch.arange(N * B, device=dev) % B
    weight = torch.where(valid, decay_weights(B, 4.0, dev)[k], 0.0)
    return hidden, target_hidden, head, labels, valid, weight


def run(impl, compiled, hidden, target_hidden, head, labels, valid, weight, **opts):
    """(sums, ∂(loss_sum / 7)/∂hidden, peak bytes of forward + backward above the start)."""
    hid = hidden.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=hidden.dtype == torch.bfloat16)
    with autocast:
        s = block_loss(hid, head, labels, weight, block_size=B, target_hidden=target_hidden, slot_valid=valid,
                       compiled=compiled, loss_impl=impl, **opts)
    (s.loss_sum / 7.0).backward()
    torch.cuda.synchronize()
    return s, hid.grad, torch.cuda.max_memory_allocated() - start


def rel_err(x, ref):
    return float((x.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("opts", [
    dict(kind="ce", position_weights="dpace"),  # the SmolLM2 config's objective, one chunk (loss_chunk null)
    dict(kind="ce_kl", position_weights="cat", logit_scale=0.8, logit_softcap=30.0, chunk_size=1024),
    # kind "ce" runs drafter/ce_rows.py's Triton kernels: with the soft-cap and CAT (the target's rows too)
    dict(kind="ce", position_weights="cat", logit_scale=0.8, logit_softcap=30.0, chunk_size=1024),
    dict(kind="ce", position_weights="decay", logit_scale=1.3),
], ids=["ce-dpace", "ce_kl-cat-softcap-chunked", "ce-cat-softcap-chunked", "ce-decay-scale"])
def test_fused_matches_autograd_in_bf16_with_no_more_memory(opts):
    """Compiled fused vs compiled autograd: same loss, weight sum and accuracy, gradient within bf16
    noise of an fp32 reference, and no higher peak memory."""
    x = inputs()
    out = {}
    for impl in ("autograd", "fused"):
        run(impl, True, *x, **opts)  # compile and allocate first
        out[impl] = run(impl, True, *x, **opts)
    hidden, target_hidden, head, labels, valid, weight = x
    ref, ref_grad, _ = run("autograd", False, hidden.float(), target_hidden.float(), head.float(), labels, valid,
                           weight, **opts)
    (a, ga, peak_a), (f, gf, peak_f) = out["autograd"], out["fused"]
    torch.testing.assert_close(f.loss_sum, a.loss_sum, rtol=1e-4, atol=0)
    torch.testing.assert_close(f.weight_sum, a.weight_sum, rtol=1e-4, atol=0)
    assert torch.equal(f.count, a.count) and torch.equal(f.num_blocks, a.num_blocks)
    assert (f.correct - a.correct).abs().sum() <= 2  # same bf16 logits; ties aside, the same argmax
    assert gf.dtype == ga.dtype == torch.bfloat16
    torch.testing.assert_close(gf.float(), ga.float(), rtol=1.6e-2, atol=1e-2 * float(ga.float().abs().max()))
    err_a, err_f = rel_err(ga, ref_grad), rel_err(gf, ref_grad)
    assert err_f <= 2 * err_a + 1e-3, (err_f, err_a)
    assert rel_err(gf, ga.float()) < 1e-2
    assert float(gf.float()[~valid].abs().max()) == 0.0  # slot 0 and invalid slots get no gradient
    assert peak_f <= peak_a, (peak_f / 2**20, peak_a / 2**20)
    print(f"\n{opts}: loss {float(a.loss_sum.detach()):.6g} vs {float(f.loss_sum.detach()):.6g}; grad rel err vs "
          f"fp32 autograd {err_a:.2e} fused {err_f:.2e}; peak MiB autograd {peak_a / 2**20:.0f} "
          f"fused {peak_f / 2**20:.0f}")
