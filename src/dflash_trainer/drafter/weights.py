"""Per-slot loss weights of a draft block: fixed decay, D-PACE and PARD-2 CAT (no host syncs).

Shapes: n = blocks, S = B−1 trained slots per block (slot k = 1..B−1 sits at column k−1).
Every function takes and returns fixed-shape tensors and leaves invalid slots at weight 0.

  decay  w_k = exp(−(k−1)/γ)                                   DFlash, arXiv 2602.06036 A.1
  dpace  w_k = Σ_{m≥k, m valid} Π_{i≤m} q̃_i,  q̃_i = (1−α)·q_i + α   D-PACE, arXiv 2605.18810 Eq. 7–8
         q_i = the drafter's own probability of slot i's label (detached)
  cat    w_k = Π_{i<k} p_T(y_i)                               PARD-2, arXiv 2605.08632 (CAT)
         p_T(y_i) = the target's probability of slot i's label y_i (given the prefix up to a+i−1)

Invalid slots (out of the document, unsupervised) count as certain (factor 1) inside the products
and carry weight 0 themselves, as the public D-PACE implementations treat masked positions.
Which denominator each option uses is `drafter/loss.py`'s business (docs/losses.md).
"""

from __future__ import annotations

from typing import Literal

import torch

from dflash_trainer.target_model.shared_head import transform_logits

PositionWeights = Literal["decay", "dpace", "cat"]
LossKind = Literal["ce", "kl", "ce_kl"]


def decay_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """[B] fp32: exp(−(k−1)/γ) for slot k = 0..B−1 (slot 0 gets e^{1/γ}; callers zero it as invalid).

    Source: DFlash paper A.1 (γ = 7 / 5 / 4 for B = 16 / 10 / 8).
    """
    if not gamma > 0:
        raise ValueError(f"gamma={gamma} must be > 0")
    k = torch.arange(block_size, device=device)
    return torch.exp(-(k - 1).to(torch.float32) / gamma)


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights of each block from the drafter's own confidence (detached).

    confidence [n,S] float: q_k, the drafter's probability of slot k's label (exp(−CE_k));
    valid [n,S] bool; alpha: smoothing α in (0, 1] (paper default 0.5).
    Returns [n,S] fp32, no gradient: w_k = Σ_{m ≥ k} v_m Π_{i ≤ m} q̃_i for valid k, else 0, where
    q̃_i = (1−α)·q_i + α on valid slots and 1 on invalid ones, v_m = 1 on valid slots.

    Π_{i≤m} q̃_i estimates the chance that the drafter's first m slots are all accepted, so w_k is
    the expected accepted length that slot k gates: the paper's Eq. 8, computed as a prefix
    product followed by a suffix sum (Algorithm 1).
    Raises ValueError when alpha is outside (0, 1] (α = 0 lets one unsure slot zero the block).
    Source: D-PACE, arXiv 2605.18810 Eq. 7–9; invalid slots as in vllm-project/speculators PR #736.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace_alpha={alpha} must be in (0, 1]; the paper uses 0.5")
    with torch.no_grad():
        q = (1.0 - alpha) * confidence.detach().float() + alpha  # [n,S] q̃
        q = torch.where(valid, q, torch.ones_like(q))
        prefix = torch.cumprod(q, dim=1)  # [n,S] Π_{i≤m} q̃_i
        prefix = torch.where(valid, prefix, torch.zeros_like(prefix))
        suffix = prefix.flip(1).cumsum(1).flip(1)  # [n,S] Σ_{m≥k}
        return torch.where(valid, suffix, torch.zeros_like(suffix))


def cat_weights(target_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """PARD-2 confidence-adaptive token (CAT) weights: the target's probability of reaching slot k.

    target_prob [n,S] float: p_T(y_k), the target's probability of slot k's label (at position
    anchor+k−1); valid [n,S] bool.
    Returns [n,S] fp32, no gradient: w_k = Π_{i<k} p_T(y_i) over the valid earlier slots (slot 1
    gets 1) for valid k, else 0. A slot behind labels the target itself finds unlikely is a
    prefix that verification rarely reaches, so it counts less.
    Source: PARD-2, arXiv 2605.08632 (CAT); AMD-AGI/PARD `pard/pard2_train.py` (the weight of draft
    offset i is the product of the target's probabilities of the i gold tokens before it).
    """
    with torch.no_grad():
        f = torch.where(valid, target_prob.detach().float(), torch.ones_like(target_prob, dtype=torch.float32))
        before = torch.cat([torch.ones_like(f[:, :1]), f[:, :-1]], dim=1)  # [n,S] factor of the slot before
        w = torch.cumprod(before, dim=1)  # [n,S] Π_{i<k}
        return torch.where(valid, w, torch.zeros_like(w))


def needs_target_hidden(kind: LossKind, position_weights: PositionWeights) -> bool:
    """Whether the loss reads the target's final hidden states (its distribution per slot):
    the KL term (kind 'kl' / 'ce_kl') and the CAT weights do; CE with decay or D-PACE does not."""
    return kind in ("kl", "ce_kl") or position_weights == "cat"


def logits_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the loss math runs in for LM-head output `x`: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def chunk_log_probs(z_raw: torch.Tensor, t_raw: torch.Tensor | None, labels: torch.Tensor, valid: torch.Tensor, *,
                    kind: LossKind, position_weights: PositionWeights, logit_scale: float,
                    logit_softcap: float | None) -> tuple[torch.Tensor, ...]:
    """What the per-slot loss reads, from raw LM-head outputs of N slots.

    z_raw [N,V] the drafter's h Wᵀ, t_raw [N,V] or None the same for the target's hidden (any float
    dtype); labels [N] int64 (any value on invalid slots), valid [N] bool. Both go through the
    target's logits function (`transform_logits`) in `logits_dtype`.
    Returns (z [N,V] the drafter's logits, logp [N,V] its log-softmax, safe [N] labels with 0 on
    invalid slots, label_logp [N] log p(label) or None when the loss and weights do not read it
    (kind "kl" without D-PACE), t_logp [N,V] the target's log-softmax or None); the inputs of
    `slot_loss_and_weight`, for the autograd and the fused loss alike."""
    z = transform_logits(z_raw.to(logits_dtype(z_raw)), logit_scale, logit_softcap)
    logp = torch.log_softmax(z, dim=-1)
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # garbage labels on invalid slots
    label_logp = None
    if kind != "kl" or position_weights == "dpace":
        label_logp = logp.gather(-1, safe[:, None]).squeeze(-1)
    t_logp = None
    if t_raw is not None:  # the target's own logits
        t_logp = torch.log_softmax(transform_logits(t_raw.to(logits_dtype(t_raw)), logit_scale, logit_softcap), dim=-1)
    return z, logp, safe, label_logp, t_logp


def slot_loss_and_weight(logp: torch.Tensor, label_logp: torch.Tensor | None, t_logp: torch.Tensor | None,
                         safe: torch.Tensor, valid: torch.Tensor, w: torch.Tensor, blocks: tuple[int, int], *,
                         kind: LossKind, ce_weight: float, kl_weight: float, position_weights: PositionWeights,
                         dpace_alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot loss ℓ and weight w of N = c·S slots of c whole blocks (blocks = (c, S)), both [N].

    logp [N,V] the drafter's log-probabilities; label_logp [N] its log-probability of the label
    (None for kind "kl" with weights other than D-PACE); t_logp [N,V] the target's (kind kl / ce_kl,
    weights cat; else None); safe [N] labels with 0 on invalid slots; valid [N] bool; w [N] the given
    (decay) weights, or the scale of D-PACE's / CAT's (`slot_weights`). ℓ: CE, KL(target ‖ drafter)
    or ce_weight·CE + kl_weight·KL; w: the given weights, or D-PACE's from the drafter's probability of
    each label or CAT's from the target's, times the scale (docs/losses.md). Used by the autograd and
    the fused loss alike."""
    if kind == "ce":
        per_slot = -label_logp
    else:
        kl = (t_logp.exp() * (t_logp - logp)).sum(-1)  # KL(target || drafter)
        per_slot = kl if kind == "kl" else ce_weight * -label_logp + kl_weight * kl
    t_label_logp = t_logp.gather(-1, safe[:, None]).squeeze(-1) if position_weights == "cat" else None
    return per_slot, slot_weights(w, label_logp, t_label_logp, valid, blocks, position_weights=position_weights,
                                  dpace_alpha=dpace_alpha)


def slot_weights(w: torch.Tensor, label_logp: torch.Tensor | None, t_label_logp: torch.Tensor | None,
                 valid: torch.Tensor, blocks: tuple[int, int], *, position_weights: PositionWeights,
                 dpace_alpha: float) -> torch.Tensor:
    """The per-slot weights [N] of N = c·S slots of c whole blocks (blocks = (c, S)): w [N] as given
    ("decay"), or D-PACE's from label_logp [N] (the drafter's log-probability of each label) or CAT's
    from t_label_logp [N] (the target's), each times w, which the caller then gives as a per-slot scale
    (1 = none; drafter/rejection.py's block scale); label_logp / t_label_logp may be None when their
    option is not chosen. valid [N] bool. Invalid slots get weight 0 from D-PACE and CAT (the given
    weights are the caller's)."""
    c, s = blocks
    if position_weights == "dpace":
        return dpace_weights(label_logp.exp().view(c, s), valid.view(c, s), dpace_alpha).reshape(-1) * w
    if position_weights == "cat":
        return cat_weights(t_label_logp.exp().view(c, s), valid.view(c, s)).reshape(-1) * w
    return w
