"""More loss weight on the blocks whose anchor sits right after a rejection (`experimental.rejection_weight`).

Why: in decoding, every anchor after the first is the position right after the last accepted draft: where
the previous block's drafts were rejected (the target's own token replaces the rejected one and anchors the
next block), or B past the previous anchor when every draft was accepted (DFlash, arXiv 2602.06036 §3, the
draft-verify loop). Only the first kind is up-weighted here: they are the anchors that follow a draft the
drafter got wrong, and the more common ones (most blocks reject before B−1). Training samples anchors
uniformly over the supervised positions, so the positions decoding actually starts blocks from are
under-represented; the measured τ of the SmolLM2 recipe (3.42 MT-Bench) falls well short of the offline
τ over uniform anchors of the same turns (4.61, benchmarks/results/recipe-smollm2-onpolicy-full_h200_2026-12-02.json).

What: for each valid block j of a row (anchor a_j) the drafter's greedy drafts are compared with the labels;
its accepted run L_j is the leading run of correct slots. When a slot is rejected (L_j < B−1 and slot
L_j+1 is valid), the next anchor decoding would take is r_j = a_j + L_j + 1. A block of the same row whose
anchor equals some r_j gets scale 1 + λ; every other block 1. With N anchors over T positions, a block is
tagged when a sampled block before it rejects exactly at its anchor: a stochastic, same-step estimate of
"decoding would anchor here", computed from this step's drafter (no stale state). The drafts come from an
extra forward pass of the LM head over the drafter's detached hidden states (`block_correct`), before the
loss pass: the loss's weights must be known before its gradient is formed (drafter/fused_loss.py).

Shapes: R rows, T positions, N anchors, B block size, S = B−1 trained slots, n = R·N blocks, H hidden, V vocab.
No host syncs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_correct(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, slot_valid: torch.Tensor,
                  block_size: int, chunk_size: int | None = None) -> torch.Tensor:
    """Whether each trained slot's greedy draft equals its label, without gradient.

    hidden [R,Q,H] the drafter's final-normed output (Q = N·B); lm_head_weight [V,H]; labels [R,Q] int64;
    slot_valid [R,Q] bool; chunk_size: at most this many slot positions per LM-head matmul (whole blocks,
    at least one; None = all at once). Returns [n,S] bool (n = R·N), False on invalid slots.
    The argmax of the raw LM-head output is the argmax of the target's logits function (a positive scale
    and a tanh soft-cap keep the order), so no transform is applied.
    Raises ValueError when block_size does not divide Q."""
    r, q, h = hidden.shape
    if q % block_size:
        raise ValueError(f"block_size={block_size} does not divide Q={q} block queries")
    n, s = r * (q // block_size), block_size - 1
    h_s = hidden.detach().reshape(n, block_size, h)[:, 1:]
    lab = labels.reshape(n, block_size)[:, 1:]
    val = slot_valid.reshape(n, block_size)[:, 1:].bool()
    per_chunk = n if chunk_size is None else max(1, chunk_size // s)
    parts = []
    with torch.no_grad():
        for c0 in range(0, n, per_chunk):
            z = F.linear(h_s[c0:c0 + per_chunk].reshape(-1, h), lm_head_weight)  # [c·S,V]
            parts.append(z.argmax(-1).view(-1, s))
    return (torch.cat(parts, dim=0) == lab) & val


def rejection_scale(correct: torch.Tensor, slot_valid: torch.Tensor, anchors: torch.Tensor,
                    anchor_valid: torch.Tensor, seq_len: int, weight: float) -> torch.Tensor:
    """Per-block loss scale: 1 + weight for a block whose anchor is where another block of its row rejects.

    correct [n,S] bool (block_correct); slot_valid [n,S] bool (the trained slots 1..B−1); anchors [R,N]
    int64 positions in [0, seq_len); anchor_valid [R,N] bool; weight λ ≥ 0. Returns [R,N] fp32.
    Block j rejects at r_j = a_j + L_j + 1 when its first L_j slots are correct and slot L_j+1 is valid and
    wrong; a block accepting every valid slot, or whose run ends at its document's end, rejects nowhere.
    Invalid blocks neither reject nor get tagged. Raises ValueError for a negative weight."""
    if weight < 0:
        raise ValueError(f"rejection_weight={weight} must be ≥ 0 (0 = off)")
    r, nb = anchors.shape
    s = correct.shape[1]
    corr = correct.view(r, nb, s).long()
    val = slot_valid.view(r, nb, s)
    run = torch.cumprod(corr, dim=2).sum(dim=2)  # [R,N] L_j: leading run of correct slots
    nxt = val.gather(2, run.clamp(max=s - 1)[..., None]).squeeze(2)  # slot L_j+1 is valid (so it was wrong)
    rejects = anchor_valid & (run < s) & nxt
    pos = torch.where(rejects, anchors + run + 1, torch.full_like(anchors, seq_len))  # seq_len = nowhere
    hit = torch.zeros(r, seq_len + 1, dtype=torch.bool, device=anchors.device)
    hit.scatter_(1, pos.clamp(max=seq_len), True)
    tagged = hit.gather(1, anchors.clamp(0, seq_len - 1)) & anchor_valid
    return 1.0 + weight * tagged.float()
