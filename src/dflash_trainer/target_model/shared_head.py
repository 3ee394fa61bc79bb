"""The target's embedding and LM head as the drafter uses them: the target's own functions, exactly.

A DFlash drafter embeds its block with the target's frozen embedding and decodes with the target's
frozen LM head (DFlash, arXiv 2602.06036 §4). Some targets do more than a table lookup and a matmul, and the
drafter does the same (DrafterConfig fields, set by `init-config` from the target,
`target_model/head_transforms.py`):

  block input   x = s_e · E[ids]                 s_e = embedding_scale  (Gemma 2/3: √H, Granite and
                                                                         Falcon-H1: embedding_multiplier)
  logits        z = s_l · (W h), then c·tanh(z/c)  s_l = logit_scale      (Granite: 1/logits_scaling,
                                                                         Falcon-H1: lm_head_multiplier)
                                                 c   = logit_softcap    (Gemma 2/3: final_logit_softcapping)

Shapes: ids [..] int64, E = W = [V,H] weights, h [..,H] → x [..,H] in the weight's dtype, z [..,V] fp32.

The embedding is read from the weight (`F.embedding`), never through the target's module: Gemma's
embedding module already multiplies by √H, and the drafter is built both around that module (eval)
and around a plain `nn.Embedding` of the same weight (training); reading the weight gives the same
values on both paths. The scale is a Python float, applied in the weight's dtype, as z-lab's
reference applies `input_embedding_scale`. transformers' Gemma rounds √H to the weight's dtype
first: identical in fp32, within 2⁻⁹ relative in bf16 (√3584 = 59.87 → 60.0). Logits are made fp32
before the transforms (transformers applies them in the head's dtype).

Monotone transforms (positive scale, soft-cap) leave the argmax alone, so greedy labels and greedy
drafts do not depend on them; the distributions (CE/KL values, D-PACE confidences, sampling at
T > 0) do, and are the target's own only with them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embed_block(ids: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale · weight[ids]: ids [..] int64, weight [V,H] → [..,H] in weight's dtype."""
    x = F.embedding(ids, weight)
    return x if scale == 1.0 else x * scale


def transform_logits(logits: torch.Tensor, scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """What the target applies to its LM head's output: × scale, then softcap·tanh(·/softcap)
    (the order and ops of transformers' Granite / Falcon-H1 / Gemma heads). Same shape and dtype."""
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, scale: float = 1.0,
                softcap: float | None = None, fp32: bool = True) -> torch.Tensor:
    """The target's logits function of a final-normed hidden: hidden [..,H], weight [V,H] → fp32 [..,V].
    fp32=False (callers that only take the argmax): a plain head (scale 1, no softcap) returns its
    output in hidden's dtype, skipping the [..,V] conversion (same argmax); a scaled or capped one
    stays fp32."""
    logits = F.linear(hidden, weight.to(hidden.dtype))
    if fp32 or scale != 1.0 or softcap is not None:
        logits = logits.float()
    return transform_logits(logits, scale, softcap)
