"""Block loss and metric sums for the DFlash drafter, all on the device (no host syncs).

Shapes: R = rows, N = anchors per row, B = block size, Q = N·B, H = hidden, V = vocabulary.
Slot k of a block predicts the token at anchor + k; slot 0 (the anchor itself) is never trained,
so only slots 1..B−1 go through the LM head, taken as a fixed-shape view [R,N,B−1,H].

Everything is returned as sums: the loss to backpropagate is `loss_sum / weight_sum` where
`weight_sum` is summed over all data-parallel ranks before dividing (the caller divides).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class LossSums:
    """On-device sums of one step. Slot index k runs over 0..B−1; slot 0 entries stay 0.

    loss_sum:        Σ w·loss over valid slots, fp32 scalar, differentiable.
    weight_sum:      Σ w over valid slots, fp32 scalar.
    correct [B]:     per slot, # valid slots whose argmax equals the label (int64).
    count [B]:       per slot, # valid slots (int64).
    run_length_sum:  Σ over blocks of the leading run of correct valid slots from k=1 (int64 scalar).
    num_blocks:      # blocks whose slot 1 is valid (int64 scalar).
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor
    run_length_sum: torch.Tensor
    num_blocks: torch.Tensor


def _chunk_sums(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, valid: torch.Tensor,
                target_h: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of c blocks, S = B−1 slots each: h [c,S,H], weight [V,H], labels/w/valid [c,S],
    target_h [c,S,H] or None -> (Σ w·loss fp32 scalar, correct [c,S] bool)."""
    c, s, hdim = h.shape
    # One contiguous [c·S, H] copy: the strided [c,S,H] view would run as c tiny batched GEMMs
    # of S rows each (measured ~10x slower for the LM head, fwd and bwd).
    h = h.reshape(c * s, hdim)
    labels, w, valid = labels.reshape(-1), w.reshape(-1), valid.reshape(-1)
    logits = F.linear(h, weight).float()  # [c·S,V] fp32, only this chunk's
    logp = torch.log_softmax(logits, dim=-1)
    if target_h is None:
        safe = torch.where(valid, labels, torch.zeros_like(labels))  # garbage labels on invalid slots
        per_slot = -logp.gather(-1, safe[:, None]).squeeze(-1)  # [c·S] CE
    else:
        t_logp = torch.log_softmax(F.linear(target_h.reshape(c * s, hdim), weight).float(), dim=-1)  # [c·S,V]
        per_slot = (t_logp.exp() * (t_logp - logp)).sum(-1)  # [c·S] KL(target || drafter)
    loss_sum = torch.where(valid, per_slot * w, torch.zeros_like(per_slot)).sum()
    correct = (logits.argmax(-1) == labels) & valid  # [c·S]
    return loss_sum, correct.view(c, s)


@functools.cache
def _compiled_chunk_sums():
    """`_chunk_sums` compiled once per process, at first use."""
    return torch.compile(_chunk_sums, dynamic=False)


def _chunk_fn(compiled: bool):
    """`_chunk_sums`, or its compiled version (one fused kernel chain for cast, log-softmax, gather,
    argmax and their backward instead of several passes over [·,V] fp32 logits)."""
    return _compiled_chunk_sums() if compiled else _chunk_sums


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, loss_weight: torch.Tensor,
               *, block_size: int, kind: Literal["ce", "kl"] = "ce", target_hidden: torch.Tensor | None = None,
               slot_valid: torch.Tensor | None = None, chunk_size: int | None = None,
               compiled: bool = False) -> LossSums:
    """Weighted block loss and accuracy sums.

    hidden [R,Q,H] drafter output (final-normed); lm_head_weight [V,H]; labels [R,Q] int64 (any value on
    invalid slots); loss_weight [R,Q] fp32 (0 on invalid slots). kind "ce": cross-entropy to labels;
    "kl": KL(target || drafter) where target_hidden [R,Q,H] is the target's final-normed hidden at
    position anchor+k−1 for slot k (gathered by the caller; both sides use lm_head_weight).
    slot_valid [R,Q] bool: which slots count (default: loss_weight > 0). chunk_size: at most this many
    slot positions (rounded down to whole blocks, at least one block) per LM-head chunk; with grad
    enabled each chunk is recomputed in backward, so only one chunk's [·,V] logits are alive at a time.
    None = one chunk. Slot 0 never reaches the LM head. Weights apply to the per-slot loss.
    compiled: run each chunk through torch.compile (CUDA; same values up to fusion rounding).
    """
    r, q, h = hidden.shape
    b = block_size
    if q % b:
        raise ValueError(f"block_size={b} does not divide Q={q} block queries")
    if kind not in ("ce", "kl"):
        raise ValueError(f"kind={kind!r}: use 'ce' or 'kl'")
    if kind == "kl" and target_hidden is None:
        raise ValueError("kind='kl' needs target_hidden [R,Q,H] (target's final hidden at anchor+k−1 per slot)")
    n_blocks = r * (q // b)
    s = b - 1
    valid = (loss_weight > 0) if slot_valid is None else slot_valid.bool()
    # Fixed-shape views: [R·N, B, ·] -> drop slot 0 -> [R·N, B−1, ·]
    h_s = hidden.reshape(n_blocks, b, h)[:, 1:]
    lab_s = labels.reshape(n_blocks, b)[:, 1:].long()
    w_s = loss_weight.reshape(n_blocks, b)[:, 1:].float()
    val_s = valid.reshape(n_blocks, b)[:, 1:]
    th_s = target_hidden.detach().reshape(n_blocks, b, h)[:, 1:] if kind == "kl" else None

    per_chunk = n_blocks if chunk_size is None else max(1, chunk_size // s)
    recompute = torch.is_grad_enabled() and hidden.requires_grad and per_chunk < n_blocks
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    correct_parts = []
    fn = _chunk_fn(compiled)
    for c0 in range(0, n_blocks, per_chunk):
        sl = slice(c0, c0 + per_chunk)
        args = (h_s[sl], lm_head_weight, lab_s[sl], w_s[sl], val_s[sl], None if th_s is None else th_s[sl])
        if recompute:
            part, corr = checkpoint(fn, *args, use_reentrant=False)
        else:
            part, corr = fn(*args)
        loss_sum = loss_sum + part
        correct_parts.append(corr)
    correct = torch.cat(correct_parts, dim=0)  # [R·N, B−1] bool

    zero = torch.zeros(1, dtype=torch.long, device=hidden.device)
    correct_k = torch.cat([zero, correct.long().sum(0)])  # [B]
    count_k = torch.cat([zero, val_s.long().sum(0)])  # [B]
    run = torch.cumprod(correct.long(), dim=1).sum()  # leading run of correct valid slots per block
    return LossSums(
        loss_sum=loss_sum,
        weight_sum=torch.where(val_s, w_s, torch.zeros_like(w_s)).sum(),
        correct=correct_k,
        count=count_k,
        run_length_sum=run,
        num_blocks=val_s[:, 0].long().sum(),
    )
