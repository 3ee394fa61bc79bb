"""Target-feature dropout for training (PARD-2, arXiv 2605.08632; docs/losses.md).

Shapes: R rows, T packed context positions, k·H feature width.

During training only, the target feature vector (all k·H values) of a random fraction of the
context is replaced by zeros before the drafter fuses it. Zeros are a neutral input: fc has no
bias and RMSNorm(0) = 0, so a dropped position contributes zero keys and values. Two units:

  document  each packed document's features are dropped whole with probability p — the analog
            of PARD-2, which zeroes a training sample's target features with probability
            `target_feat_mask` (0.1 in its Qwen3 recipe; AMD-AGI/PARD `pard/pard2_train.py`);
  position  each context position is dropped independently with probability p.

The draws come from the step's anchor generators (one per row), after the anchors were drawn,
so the anchors are unchanged, a row's drops depend only on (seed, epoch, row, draw), and a
resumed run draws the same drops. No host syncs.
"""

from __future__ import annotations

from typing import Literal

import torch

from dflash_trainer.drafter.anchors import row_uniforms

DropoutUnit = Literal["document", "position"]


def feature_keep_mask(position_ids: torch.Tensor, p: float, unit: DropoutUnit,
                      generator: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    """Which context positions keep their target features.

    position_ids [R,T] int (restart at 0 in each packed document); p: drop probability in [0, 1);
    unit: "document" (a whole document is kept or dropped: the decision of document d is the
    uniform drawn at its first position) or "position" (each position on its own).
    generator: as for `sample_anchors` (per-row list, one generator, or None = global RNG).
    Returns keep [R,T] bool (True = keep). Draws R·T uniforms whatever the unit.
    Raises ValueError naming the field: p outside [0, 1), unknown unit, non-2-D position_ids.
    Source: PARD-2 (arXiv 2605.08632) target-feature masking, applied per packed document.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"feature_dropout={p} must be in [0, 1)")
    if unit not in ("document", "position"):
        raise ValueError(f"feature_dropout_unit={unit!r}: use 'document' or 'position'")
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must be [R,T]")
    R, T = position_ids.shape
    u = row_uniforms(generator, R, T, position_ids.device)  # [R,T]
    if unit == "document":
        doc_start = (torch.arange(T, device=position_ids.device) - position_ids.long()).clamp(0, T - 1)  # [R,T]
        u = u.gather(1, doc_start)  # [R,T] the document's draw at every position
    return u >= p


def drop_features(features: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """features [R,T,k·H] with the positions where keep [R,T] is False set to zero (a new tensor)."""
    return features * keep[..., None].to(features.dtype)
