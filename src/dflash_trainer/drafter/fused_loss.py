"""LM head + block loss with the hidden's gradient computed in the forward pass (`loss_impl: fused`).

Shapes: R rows, Q = N·B block queries, n = R·N blocks, S = B−1 trained slots per block, c blocks per
chunk, H hidden, V vocabulary. Values and options are those of `drafter/loss.py` (docs/losses.md);
this module only changes how d(loss_sum)/d(hidden) is obtained.

The autograd path (`loss_impl: autograd`) keeps, per chunk, what log-softmax needs for backward (or
recomputes the chunk in backward when chunked) and then runs backward through log-softmax, the
logit transform and the LM head again. The LM head W is the target's and frozen, so the only
gradient wanted is the hidden's, and the gradient of the weighted per-slot loss with respect to the
logits is closed-form. With z = t(z_raw), z_raw = h Wᵀ, p = softmax(z), g = w on valid slots (0
elsewhere):

    ce     ∂(g·ℓ)/∂z = g · (p − onehot(y))
    kl     ∂(g·ℓ)/∂z = g · (p − p_T)                     KL(p_T ‖ p), Σ p_T = 1
    ce_kl  ∂(g·ℓ)/∂z = g · ((a+b)·p − a·onehot(y) − b·p_T)   a, b = ce_weight, kl_weight
    t      z = s·z_raw, then c·tanh(z/c):  ∂z/∂z_raw = s · (1 − (z/c)²)   (s only without soft-cap)

The weights w (decay: given; D-PACE: from the drafter's detached confidences; CAT: from the target)
carry no gradient on the autograd path either (drafter/weights.py detaches them), so they enter as
constants. Per chunk: one [c·S,H]×[H,V] matmul to the logits, one elementwise/reduction pass that
gives the sums and ∂/∂z_raw in the matmul's dtype, one [c·S,V]×[V,H] matmul to ∂/∂h; no [·,V]
tensor outlives its chunk. The autograd.Function keeps only ∂(loss_sum)/∂hidden [R,Q,H] and its
backward multiplies it by the incoming scalar (the caller's 1 / global weight sum).
For kind "ce" (any position weights) the elementwise pass is two passes over each row
(drafter/ce_rows.py: Triton kernels on CUDA): row statistics, then the gradient in place
(`_ce_sums_and_logit_grad`). For the other kinds, with `compiled`, it is torch.compile'd (one graph
per option set and chunk shape: on CUDA a few fused kernels, no [·,V] fp32 intermediates in memory).
The matmuls stay plain F.linear / mm in the input dtype (bf16 under the step's autocast on CUDA).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from dflash_trainer.drafter.ce_rows import ce_logit_grad_, row_stats
from dflash_trainer.drafter.own_frame import compile_own_frame
from dflash_trainer.drafter.weights import chunk_log_probs, logits_dtype, slot_loss_and_weight, slot_weights


def _sums_and_logit_grad(z_raw: torch.Tensor, t_raw: torch.Tensor | None, labels: torch.Tensor, w: torch.Tensor,
                         valid: torch.Tensor, opts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The elementwise/reduction part of one chunk (the part `compiled` compiles).

    z_raw [c·S,V]: the drafter's LM-head output h Wᵀ (before the target's transform), in the matmul
    dtype; OVERWRITTEN with ∂(Σ w·ℓ)/∂z_raw in that dtype (in place: the chunk holds one [c·S,V]
    buffer for logits and gradient). t_raw [c·S,V] or None: the same for the target's hidden (KL
    term, CAT weights), read only; labels [c,S] int64 (any value on invalid slots), w [c,S] fp32
    (decay weights), valid [c,S] bool; opts: loss.LossOptions.
    Returns (Σ w·ℓ scalar, Σ w scalar, correct [c,S] bool) exactly as `loss._chunk_sums` computes
    them (fp32; the loss sum in fp64 for fp64 inputs)."""
    c, s = labels.shape
    labels, w, valid = labels.reshape(-1), w.reshape(-1), valid.reshape(-1)
    acc = logits_dtype(z_raw)
    z, logp, safe, label_logp, t_logp = chunk_log_probs(  # [c·S,V] in acc
        z_raw, t_raw, labels, valid, kind=opts.kind, position_weights=opts.position_weights,
        logit_scale=opts.logit_scale, logit_softcap=opts.logit_softcap)
    p = logp.exp()
    ce_w, kl_w = {"ce": (1.0, 0.0), "kl": (0.0, 1.0), "ce_kl": (opts.ce_weight, opts.kl_weight)}[opts.kind]
    per_slot, w = slot_loss_and_weight(logp, label_logp, t_logp, safe, valid, w, (c, s), kind=opts.kind,
                                       ce_weight=opts.ce_weight, kl_weight=opts.kl_weight,
                                       position_weights=opts.position_weights, dpace_alpha=opts.dpace_alpha)
    w = torch.where(valid, w, torch.zeros_like(w))  # [c·S] fp32: ∂loss_sum/∂ℓ per slot, 0 when invalid
    loss_sum = torch.where(valid, per_slot * w, torch.zeros_like(per_slot)).sum()
    weight_sum = w.sum()
    g = w.to(acc)
    correct = (z.argmax(-1) == labels) & valid
    # ∂(g·ℓ)/∂z = g·((a+b)·p − a·onehot(y) − b·p_T)
    grad = p * (g * (ce_w + kl_w))[:, None]
    if ce_w:
        onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == safe[:, None]  # [c·S,V] (fused when compiled)
        grad = grad - torch.where(onehot, (g * ce_w)[:, None], torch.zeros_like(grad))
    if kl_w:
        grad = grad - t_logp.exp() * (g * kl_w)[:, None]
    if opts.logit_softcap is not None:  # z = c·tanh(s·z_raw / c): ∂z/∂z_raw = s·(1 − (z/c)²)
        grad = grad * (opts.logit_scale * (1.0 - (z / opts.logit_softcap) ** 2))
    elif opts.logit_scale != 1.0:
        grad = grad * opts.logit_scale
    z_raw.copy_(grad)  # last: z may alias z_raw (fp32 input without transform)
    return loss_sum, weight_sum, correct.view(c, s)


def _ce_sums_and_logit_grad(z_raw: torch.Tensor, t_raw: torch.Tensor | None, labels: torch.Tensor, w: torch.Tensor,
                            valid: torch.Tensor, opts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_sums_and_logit_grad` for kind "ce" (any position weights) in two passes over each [c·S,V] row
    (drafter/ce_rows.py: Triton kernels on CUDA): row statistics (lse, the label's logit, argmax; of
    t_raw too for CAT), the per-slot weights from them, then the gradient written over z_raw. Same
    arguments, results and in-place contract; no [c·S,V] tensor besides z_raw (and t_raw, read only)."""
    c, s = labels.shape
    labels, w, valid = labels.reshape(-1), w.reshape(-1), valid.reshape(-1)
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    scale, cap = opts.logit_scale, opts.logit_softcap
    lse, z_y, amax = row_stats(z_raw, safe, scale, cap)  # [c·S] each
    label_logp = z_y - lse
    t_label_logp = None
    if opts.position_weights == "cat":
        t_lse, t_y, _ = row_stats(t_raw, safe, scale, cap)
        t_label_logp = t_y - t_lse
    w = slot_weights(w, label_logp, t_label_logp, valid, (c, s), position_weights=opts.position_weights,
                     dpace_alpha=opts.dpace_alpha)
    w = torch.where(valid, w, torch.zeros_like(w)).float()  # [c·S]: ∂loss_sum/∂ℓ per slot, 0 when invalid
    loss_sum = torch.where(valid, -label_logp * w.to(label_logp.dtype), torch.zeros_like(label_logp)).sum()
    weight_sum = w.sum()
    correct = (amax == labels) & valid
    ce_logit_grad_(z_raw, safe, lse, w, scale, cap)
    return loss_sum, weight_sum, correct.view(c, s)


@functools.cache
def _compiled(opts):
    """`_sums_and_logit_grad` for `opts`, compiled once per process and options, at first use, under a
    code object of its own (drafter/own_frame.py: dynamo's recompile limit then counts this option set's
    variants only; past the limit it would run eagerly, with [·,V] fp32 intermediates in memory)."""
    def elementwise_pass(z_raw, t_raw, labels, w, valid):
        return _sums_and_logit_grad(z_raw, t_raw, labels, w, valid, opts)

    return compile_own_frame(elementwise_pass, dynamic=False)


class _FusedHeadLoss(torch.autograd.Function):
    """(hidden, …) → (loss_sum, weight_sum, correct); ∂loss_sum/∂hidden is computed in forward and
    kept (hidden's shape and dtype); backward scales it by the incoming gradient of loss_sum."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, w, valid, target_h, opts, per_chunk, compiled):
        n, s = labels.shape
        hdim = hidden.shape[-1]
        h_s = hidden.reshape(n, s + 1, hdim)[:, 1:]  # [n,S,H] view: slot 0 never reaches the LM head
        grad = hidden.new_zeros(n, s + 1, hdim)  # ∂loss_sum/∂hidden as blocks; slot 0 stays 0
        if opts.kind == "ce":  # two memory-speed passes (Triton on CUDA), compiled or not
            fn = functools.partial(_ce_sums_and_logit_grad, opts=opts)
        else:
            fn = _compiled(opts) if compiled else functools.partial(_sums_and_logit_grad, opts=opts)
        loss_sum = weight_sum = None
        correct = []
        for c0 in range(0, n, per_chunk):
            sl = slice(c0, c0 + per_chunk)
            h_c = h_s[sl].reshape(-1, hdim)  # one contiguous [c·S,H] copy (see loss._chunk_sums)
            z_raw = F.linear(h_c, weight)  # [c·S,V] in the input dtype (bf16 under the step's autocast)
            t_raw = None if target_h is None else F.linear(target_h[sl].reshape(-1, hdim), weight)
            part, wpart, corr = fn(z_raw, t_raw, labels[sl], w[sl], valid[sl])  # z_raw := ∂/∂z_raw
            del t_raw
            grad[sl, 1:] = torch.mm(z_raw, weight.to(z_raw.dtype)).view(-1, s, hdim)  # [c·S,V]×[V,H]
            del z_raw
            loss_sum = part if loss_sum is None else loss_sum + part
            weight_sum = wpart if weight_sum is None else weight_sum + wpart
            correct.append(corr)
        ctx.save_for_backward(grad.view(hidden.shape))
        ctx.mark_non_differentiable(weight_sum)
        return loss_sum, weight_sum, torch.cat(correct, dim=0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_weight_sum, _grad_correct):
        (grad,) = ctx.saved_tensors
        dt = torch.promote_types(grad.dtype, grad_loss.dtype)  # scale in fp32 (a bf16 scale would round it)
        return ((grad.to(dt) * grad_loss.to(dt)).to(grad.dtype),) + (None,) * 8


def fused_block_sums(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor,
                     valid: torch.Tensor, target_h: torch.Tensor | None, opts, per_chunk: int,
                     compiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ w·ℓ, Σ w and per-slot correctness of all blocks, chunk by chunk, with ∂/∂hidden from forward.

    hidden [R,Q,H] (requires grad; Q = n·B / R), weight [V,H] the frozen LM head (no gradient: a
    weight that requires one is refused by the caller), labels [n,S] int64, w [n,S] fp32 (decay
    weights; for "dpace" / "cat" a per-slot scale of the weights they compute per chunk), valid [n,S] bool, target_h [n,S,H] (detached)
    or None; opts: loss.LossOptions; per_chunk: whole blocks per chunk (≥ 1); compiled: compile the
    elementwise pass (CUDA).
    Returns (loss_sum, weight_sum, correct [n,S] bool): the values `loss._chunk_sums` gives summed
    over the chunks (fp32 scalars, fp64 for fp64 inputs); loss_sum is differentiable w.r.t. hidden,
    weight_sum carries no gradient. No host syncs.
    """
    return _FusedHeadLoss.apply(hidden, weight, labels, w, valid, target_h, opts, per_chunk, compiled)
