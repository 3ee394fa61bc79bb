"""Block loss and metric sums for the DFlash drafter, all on the device (no host syncs).

Shapes: R = rows, N = anchors per row, B = block size, Q = N·B, H = hidden, V = vocabulary.
Slot k of a block predicts the token at anchor + k; slot 0 (the anchor itself) is never trained,
so only slots 1..B−1 go through the LM head, taken as a fixed-shape view [R,N,B−1,H].

Everything is returned as sums: the loss to backpropagate is `loss_sum / weight_sum` where
`weight_sum` is summed over all data-parallel ranks before dividing (the caller divides).
The per-slot loss (CE, KL or PARD-2's CE+KL mix) and the per-slot weights (fixed decay, D-PACE,
PARD-2 CAT; drafter/weights.py) are chosen by arguments; docs/losses.md gives the formulas.
Logits on both sides (drafter and, for KL / CAT, target) are the target's own logits function:
the LM head, then the target's logit scale and soft-cap (target_model/shared_head.py), so the teacher
distribution is the target's real one and the drafter's is parametrized the same way.
How the hidden's gradient is obtained is `loss_impl`: autograd through this module's chunks, or the
closed form computed in the forward pass (drafter/fused_loss.py); the sums are the same.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_trainer.drafter.fused_loss import fused_block_sums
from dflash_trainer.drafter.own_frame import compile_own_frame
from dflash_trainer.drafter.weights import (LossKind, PositionWeights, chunk_log_probs, needs_target_hidden,
                                            slot_loss_and_weight)

LossImpl = Literal["autograd", "fused"]


@dataclass
class LossSums:
    """On-device sums of one step. Slot index k runs over 0..B−1; slot 0 entries stay 0.

    loss_sum:        Σ w·loss over valid slots, fp32 scalar, differentiable.
    weight_sum:      the denominator, fp32 scalar: Σ w over valid slots (for D-PACE with
                     denominator "blocks": the number of blocks with a valid slot, each counted
                     with its block scale when one is given).
    correct [B]:     per slot, # valid slots whose argmax equals the label (int64).
    count [B]:       per slot, # valid slots (int64).
    run_length_sum:  Σ over blocks of the leading run of correct valid slots from k=1 (int64 scalar).
    num_blocks:      # blocks whose slot 1 is valid (int64 scalar).
    runs [n]:        per block (R·N of them, row-major), that leading run (int64); not summed over steps
                     (MetricAccumulator leaves it out): offline τ's walk over decoding's anchors reads it.
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor
    run_length_sum: torch.Tensor
    num_blocks: torch.Tensor
    runs: torch.Tensor | None = None


@dataclass(frozen=True)
class LossOptions:
    """What the per-slot loss and weights are (static per run; also the compile cache key).

    kind: "ce" = CE to the label, "kl" = KL(target ‖ drafter), "ce_kl" = ce_weight·CE + kl_weight·KL.
    position_weights: "decay" (the caller's loss_weight), "dpace" or "cat" (drafter/weights.py).
    dpace_alpha: D-PACE smoothing α. dpace_denominator: what the D-PACE loss is divided by
    ("blocks" = valid blocks, "weights" = Σ w). logit_scale / logit_softcap: the target's transform
    of its LM head's output (DrafterConfig fields of the same names), applied to every logit here.
    """

    kind: LossKind = "ce"
    position_weights: PositionWeights = "decay"
    dpace_alpha: float = 0.5
    dpace_denominator: Literal["blocks", "weights"] = "blocks"
    ce_weight: float = 0.1
    kl_weight: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None


def _chunk_sums(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, valid: torch.Tensor,
                target_h: torch.Tensor | None, opts: LossOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of c whole blocks, S = B−1 slots each: h [c,S,H], weight [V,H], labels/w/valid [c,S],
    target_h [c,S,H] or None -> (Σ w·loss fp32 scalar, Σ w fp32 scalar, correct [c,S] bool).

    w is used as given for position_weights "decay"; "dpace" / "cat" compute weights here from this
    chunk's logits (whole blocks, so the per-block products are complete) and multiply them by w, then
    a per-slot scale (1 = none; `block_loss`'s block_scale)."""
    c, s, hdim = h.shape
    # One contiguous [c·S, H] copy: the strided [c,S,H] view would run as c tiny batched GEMMs
    # of S rows each (measured ~10x slower for the LM head, fwd and bwd).
    h = h.reshape(c * s, hdim)
    labels, w, valid = labels.reshape(-1), w.reshape(-1), valid.reshape(-1)
    t_raw = None if target_h is None else F.linear(target_h.reshape(c * s, hdim), weight)
    logits, logp, safe, label_logp, t_logp = chunk_log_probs(  # [c·S,V] fp32
        F.linear(h, weight), t_raw, labels, valid, kind=opts.kind, position_weights=opts.position_weights,
        logit_scale=opts.logit_scale, logit_softcap=opts.logit_softcap)
    per_slot, w = slot_loss_and_weight(logp, label_logp, t_logp, safe, valid, w, (c, s), kind=opts.kind,
                                       ce_weight=opts.ce_weight, kl_weight=opts.kl_weight,
                                       position_weights=opts.position_weights, dpace_alpha=opts.dpace_alpha)
    loss_sum = torch.where(valid, per_slot * w, torch.zeros_like(per_slot)).sum()
    weight_sum = torch.where(valid, w, torch.zeros_like(w)).sum()
    correct = (logits.argmax(-1) == labels) & valid  # [c·S]
    return loss_sum, weight_sum, correct.view(c, s)


@functools.cache
def _compiled_chunk_sums(opts: LossOptions):
    """`_chunk_sums` for `opts`, compiled once per process and options, at first use, under a code
    object of its own (drafter/own_frame.py)."""
    def chunk_pass(h, weight, labels, w, valid, target_h):
        return _chunk_sums(h, weight, labels, w, valid, target_h, opts)

    return compile_own_frame(chunk_pass, dynamic=False)


def _chunk_fn(compiled: bool, opts: LossOptions):
    """`_chunk_sums` bound to `opts`, or its compiled version (one fused kernel chain for cast,
    log-softmax, gather, argmax and their backward instead of several passes over [·,V] fp32 logits)."""
    return _compiled_chunk_sums(opts) if compiled else functools.partial(_chunk_sums, opts=opts)


def _autograd_sums(h_s, weight, lab_s, w_s, val_s, th_s, opts: LossOptions, per_chunk: int, compiled: bool,
                   recompute: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_chunk_sums` over chunks of `per_chunk` blocks: h_s [n,S,H], lab_s/w_s/val_s [n,S], th_s [n,S,H]
    or None -> (Σ w·loss, Σ w detached, correct [n,S] bool). recompute: checkpoint each chunk (only
    one chunk's [·,V] logits alive at a time in backward)."""
    loss_sum = h_s.new_zeros((), dtype=torch.float32)
    weight_sum = h_s.new_zeros((), dtype=torch.float32)
    correct_parts = []
    fn = _chunk_fn(compiled, opts)
    for c0 in range(0, h_s.shape[0], per_chunk):
        sl = slice(c0, c0 + per_chunk)
        args = (h_s[sl], weight, lab_s[sl], w_s[sl], val_s[sl], None if th_s is None else th_s[sl])
        if recompute:
            part, wpart, corr = checkpoint(fn, *args, use_reentrant=False)
        else:
            part, wpart, corr = fn(*args)
        loss_sum = loss_sum + part
        weight_sum = weight_sum + wpart.detach()
        correct_parts.append(corr)
    return loss_sum, weight_sum, torch.cat(correct_parts, dim=0)


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, loss_weight: torch.Tensor,
               *, block_size: int, kind: LossKind = "ce", target_hidden: torch.Tensor | None = None,
               slot_valid: torch.Tensor | None = None, chunk_size: int | None = None,
               compiled: bool = False, position_weights: PositionWeights = "decay", dpace_alpha: float = 0.5,
               dpace_denominator: Literal["blocks", "weights"] = "blocks", ce_weight: float = 0.1,
               kl_weight: float = 1.0, logit_scale: float = 1.0, logit_softcap: float | None = None,
               loss_impl: LossImpl = "autograd", block_scale: torch.Tensor | None = None) -> LossSums:
    """Weighted block loss and accuracy sums (docs/losses.md has every option's formula and source).

    hidden [R,Q,H] drafter output (final-normed); lm_head_weight [V,H]; labels [R,Q] int64 (any value on
    invalid slots); loss_weight [R,Q] fp32 (0 on invalid slots; the decay weights).
    kind, the per-slot loss ℓ: "ce" = CE to the label; "kl" = KL(target ‖ drafter); "ce_kl" =
    ce_weight·CE + kl_weight·KL (PARD-2's mix). target_hidden [R,Q,H]: the target's final-normed
    hidden at position anchor+k−1 for slot k (gathered by the caller; both sides use
    lm_head_weight), needed by the KL term and by position_weights "cat".
    position_weights, the per-slot weight w: "decay" = loss_weight; "dpace" = D-PACE weights from the
    drafter's own (detached) probability of each label, smoothing dpace_alpha; "cat" = PARD-2's
    product of the target's probabilities of the earlier labels (drafter/weights.py).
    Returned loss_sum = Σ_valid w·ℓ; weight_sum = the denominator the caller divides by after summing
    it over ranks: Σ_valid w, except D-PACE with dpace_denominator "blocks" (the default), where it
    is the number of blocks with a valid slot (D-PACE's weights are expected accepted lengths; a
    sum of weights would cancel their scale, SpecForge #828).
    slot_valid [R,Q] bool: which slots count (default: loss_weight > 0). chunk_size: at most this many
    slot positions (rounded down to whole blocks, at least one block) per LM-head chunk; with grad
    enabled each chunk is recomputed in backward, so only one chunk's [·,V] logits are alive at a time.
    None = one chunk. Slot 0 never reaches the LM head.
    compiled: run each chunk through torch.compile (CUDA; same values up to fusion rounding).
    logit_scale / logit_softcap: the target's logits function after the LM head (target_model/shared_head.py;
    the drafter config's fields), on the drafter's and the target's logits alike.
    loss_impl: how the gradient w.r.t. hidden is obtained when one is needed. "autograd" = backward
    through log-softmax and the LM head (chunks recomputed in backward); "fused" = the closed-form
    gradient computed chunk by chunk in forward and kept as one [R,Q,H] tensor (drafter/fused_loss.py;
    same sums, gradient equal up to rounding; lm_head_weight must not require grad). Without a
    gradient to compute (no_grad, validation) both run the autograd path's forward.
    block_scale [R,N] fp32 or None: each block's weights times this (drafter/rejection.py); D-PACE's
    "blocks" denominator then counts each valid block with its scale. None = 1 (the values unchanged).
    Raises ValueError naming the argument for an unknown kind / position_weights / dpace_denominator /
    loss_impl, a missing target_hidden, a negative or all-zero ce_weight/kl_weight, block_size not
    dividing Q, or loss_impl "fused" with an lm_head_weight that requires grad.
    """
    r, q, h = hidden.shape
    b = block_size
    if q % b:
        raise ValueError(f"block_size={b} does not divide Q={q} block queries")
    if kind not in ("ce", "kl", "ce_kl"):
        raise ValueError(f"kind={kind!r}: use 'ce', 'kl' or 'ce_kl'")
    if position_weights not in ("decay", "dpace", "cat"):
        raise ValueError(f"position_weights={position_weights!r}: use 'decay', 'dpace' or 'cat'")
    if dpace_denominator not in ("blocks", "weights"):
        raise ValueError(f"dpace_denominator={dpace_denominator!r}: use 'blocks' or 'weights'")
    if kind == "ce_kl" and (ce_weight < 0 or kl_weight < 0 or ce_weight + kl_weight == 0):
        raise ValueError(f"ce_weight={ce_weight}, kl_weight={kl_weight}: use non-negative weights, not both 0")
    if loss_impl not in ("autograd", "fused"):
        raise ValueError(f"loss_impl={loss_impl!r}: use 'autograd' or 'fused'")
    if loss_impl == "fused" and lm_head_weight.requires_grad:
        raise ValueError("loss_impl='fused' computes no gradient for lm_head_weight (the target's frozen LM head), "
                         "but it requires grad; freeze it or use loss_impl='autograd'")
    if needs_target_hidden(kind, position_weights) and target_hidden is None:
        raise ValueError(f"kind={kind!r} with position_weights={position_weights!r} needs target_hidden [R,Q,H] "
                         "(target's final hidden at anchor+k−1 per slot)")
    opts = LossOptions(kind, position_weights, float(dpace_alpha), dpace_denominator, float(ce_weight),
                       float(kl_weight), float(logit_scale), None if logit_softcap is None else float(logit_softcap))
    n_blocks = r * (q // b)
    s = b - 1
    valid = (loss_weight > 0) if slot_valid is None else slot_valid.bool()
    # Fixed-shape views: [R·N, B, ·] -> drop slot 0 -> [R·N, B−1, ·]
    h_s = hidden.reshape(n_blocks, b, h)[:, 1:]
    lab_s = labels.reshape(n_blocks, b)[:, 1:].long()
    if position_weights == "decay":  # the given weights (times the block scale)
        w_s = loss_weight.reshape(n_blocks, b)[:, 1:].float()
        if block_scale is not None:
            w_s = w_s * block_scale.reshape(n_blocks, 1).float()
    else:  # D-PACE / CAT compute their own weights per chunk and multiply them by this per-slot scale
        scale = torch.ones(n_blocks, 1, device=hidden.device) if block_scale is None else \
            block_scale.reshape(n_blocks, 1).float()
        w_s = scale.expand(n_blocks, s).contiguous()
    val_s = valid.reshape(n_blocks, b)[:, 1:]
    th_s = None
    if needs_target_hidden(kind, position_weights):
        th_s = target_hidden.detach().reshape(n_blocks, b, h)[:, 1:]

    per_chunk = n_blocks if chunk_size is None else max(1, chunk_size // s)
    with_grad = torch.is_grad_enabled() and hidden.requires_grad
    if loss_impl == "fused" and with_grad:
        loss_sum, chunk_weight_sum, correct = fused_block_sums(hidden, lm_head_weight, lab_s, w_s, val_s, th_s, opts,
                                                               per_chunk, compiled)
    else:
        loss_sum, chunk_weight_sum, correct = _autograd_sums(h_s, lm_head_weight, lab_s, w_s, val_s, th_s, opts,
                                                             per_chunk, compiled, with_grad and per_chunk < n_blocks)

    if position_weights == "decay":  # the given weights, summed in one pass as always
        weight_sum = torch.where(val_s, w_s, torch.zeros_like(w_s)).sum()
    elif position_weights == "dpace" and dpace_denominator == "blocks":
        has_slot = val_s.any(dim=1)  # blocks with a valid slot (each counted with its scale)
        weight_sum = (has_slot.sum().float() if block_scale is None else
                      torch.where(has_slot, block_scale.reshape(-1).float(), torch.zeros_like(w_s[:, 0])).sum())
    else:
        weight_sum = chunk_weight_sum
    zero = torch.zeros(1, dtype=torch.long, device=hidden.device)
    correct_k = torch.cat([zero, correct.long().sum(0)])  # [B]
    count_k = torch.cat([zero, val_s.long().sum(0)])  # [B]
    runs = torch.cumprod(correct.long(), dim=1).sum(dim=1)  # [n] leading run of correct valid slots per block
    return LossSums(
        loss_sum=loss_sum,
        weight_sum=weight_sum,
        correct=correct_k,
        count=count_k,
        run_length_sum=runs.sum(),
        num_blocks=val_s[:, 0].long().sum(),
        runs=runs,
    )
