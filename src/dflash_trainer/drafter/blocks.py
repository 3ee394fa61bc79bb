"""Anchors → draft-block tensors (DFlash, arXiv 2602.06036 §4; `tests/assets/tiny_row.json`).

Shapes: R rows, T packed tokens, N anchors per row, B block size, Q = N·B block queries;
query q = j·B + k is slot k of the block of anchor j.

Block j = [token at a_j, MASK × (B−1)] at positions pos(a_j)+0 … pos(a_j)+B−1. Slot k predicts
the token at a_j + k (no shift); slot 0 is never trained. Its context is the target features of
[doc_start(a_j), a_j). Worked by hand in tests/assets/tiny_row.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dflash_trainer.drafter.weights import decay_weights


@dataclass
class Blocks:
    """Per-row block layout; every tensor lives on the input's device.

    context_lo, context_hi: [R,N] int32, context range [doc_start(a_j), a_j) of each anchor;
        [0,0) for invalid anchors.
    anchors: [R,N] int64 (sorted); anchor_valid: [R,N] bool.
    block_input_ids: [R,Q] int64, anchor token then the mask token (all mask for invalid anchors).
    block_position_ids: [R,Q] int64, pos(a_j)+k (0+k for invalid anchors).
    labels: [R,Q] int64, label of slot k (0 where the slot is not valid).
    slot_valid: [R,Q] bool, k ≥ 1, anchor valid, a_j+k < T, same document, supervised.
    loss_weight: [R,Q] float32, exp(−(k−1)/γ) where slot_valid, else 0.
    """

    context_lo: torch.Tensor
    context_hi: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    block_input_ids: torch.Tensor
    block_position_ids: torch.Tensor
    labels: torch.Tensor
    slot_valid: torch.Tensor
    loss_weight: torch.Tensor


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor,
                 anchors: torch.Tensor, anchor_valid: torch.Tensor, *, block_size: int, mask_token_id: int,
                 gamma: float, label_source: Literal["data", "target"],
                 target_argmax: torch.Tensor | None) -> Blocks:
    """Lay out the draft blocks of sampled anchors (vectorized, no host syncs).

    input_ids, loss_mask, position_ids: [R,T] (any integer/bool dtypes; position ids restart at 0
    per document). anchors: [R,N] int64 positions in [0,T) (clamped before use),
    anchor_valid: [R,N] bool. target_argmax: [R,T] int64, the target's greedy next-token
    prediction at each position; required when label_source == "target".

    Labels of slot k of anchor a: "data" → input_ids[a+k] (regenerated data);
    "target" → target_argmax[a+k−1] (online distillation: the target's prediction of a+k).
    A slot is valid iff k ≥ 1, the anchor is valid, a+k < T, a+k is in a's document
    (position_ids[a+k] == position_ids[a] + k) and loss_mask[a+k]. Weight exp(−(k−1)/γ).

    Returns Blocks (see the class for shapes and dtypes).
    Raises ValueError naming the field: label_source unknown, target_argmax missing for
    label_source "target", block_size < 1, gamma <= 0, or mismatched shapes.
    Source: DFlash paper §4 (block layout, no label shift) and A.1 (γ decay); a row worked by
    hand in `tests/assets/tiny_row.json`.
    """
    if label_source not in ("data", "target"):
        raise ValueError(f"label_source={label_source!r}: use 'data' or 'target'")
    if label_source == "target" and target_argmax is None:
        raise ValueError("target_argmax is required when label_source == 'target' "
                         "(pass the target's argmax [R,T] or use label_source='data')")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if not gamma > 0:
        raise ValueError(f"gamma={gamma} must be > 0")
    if input_ids.dim() != 2 or not (input_ids.shape == loss_mask.shape == position_ids.shape):
        raise ValueError(f"input_ids {tuple(input_ids.shape)}, loss_mask {tuple(loss_mask.shape)}, position_ids "
                         f"{tuple(position_ids.shape)} must all be [R,T]")
    if anchors.dim() != 2 or anchors.shape != anchor_valid.shape or anchors.shape[0] != input_ids.shape[0]:
        raise ValueError(f"anchors {tuple(anchors.shape)} and anchor_valid {tuple(anchor_valid.shape)} must be [R,N]")
    if target_argmax is not None and label_source == "target" and target_argmax.shape != input_ids.shape:
        raise ValueError(f"target_argmax {tuple(target_argmax.shape)} must be [R,T] like input_ids")

    R, T = input_ids.shape
    N = anchors.shape[1]
    B = block_size
    device = input_ids.device
    pos = position_ids.long()
    a = anchors.long().clamp(0, T - 1)  # [R,N]
    ok = anchor_valid.bool()  # [R,N]
    pos_a = pos.gather(1, a)  # [R,N]

    context_lo = torch.where(ok, a - pos_a, 0).to(torch.int32)  # [R,N] doc_start(a)
    context_hi = torch.where(ok, a, 0).to(torch.int32)  # [R,N]

    k = torch.arange(B, device=device)  # [B]
    tok = a[:, :, None] + k  # [R,N,B] token position a+k
    in_row = tok < T
    tok_c = tok.clamp(max=T - 1).view(R, N * B)  # [R,Q]
    same_doc = pos.gather(1, tok_c).view(R, N, B) == pos_a[:, :, None] + k
    supervised = loss_mask.bool().gather(1, tok_c).view(R, N, B)
    slot_valid = (k >= 1) & ok[:, :, None] & in_row & same_doc & supervised  # [R,N,B]

    anchor_tok = torch.where(ok, input_ids.long().gather(1, a), mask_token_id)  # [R,N]
    block_input_ids = torch.where(k == 0, anchor_tok[:, :, None], mask_token_id)  # [R,N,B]
    block_position_ids = torch.where(ok, pos_a, 0)[:, :, None] + k  # [R,N,B]

    if label_source == "data":
        raw = input_ids.long().gather(1, tok_c)  # [R,Q] token at a+k
    else:
        prev = (tok - 1).clamp(0, T - 1).view(R, N * B)
        raw = target_argmax.long().gather(1, prev)  # [R,Q] target's prediction of a+k
    labels = torch.where(slot_valid.view(R, N * B), raw, 0)

    decay = decay_weights(B, gamma, device)  # [B]
    loss_weight = torch.where(slot_valid, decay, 0.0).to(torch.float32)  # [R,N,B]

    Q = N * B
    return Blocks(
        context_lo=context_lo,
        context_hi=context_hi,
        anchors=anchors.long(),
        anchor_valid=ok,
        block_input_ids=block_input_ids.reshape(R, Q),
        block_position_ids=block_position_ids.reshape(R, Q),
        labels=labels,
        slot_valid=slot_valid.reshape(R, Q),
        loss_weight=loss_weight.reshape(R, Q),
    )
