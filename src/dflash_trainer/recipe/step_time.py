"""How long a training step of another target takes than the measured SmolLM2 one: the plan times the
SmolLM2 step from its own runs (recipe/plan.py) and scales it by this module's ratio for any other shape.

The ratio compares FLOPs per context token at an achieved rate that grows with the width:

- FLOPs per context token = (1 − served) · 2 · P (the target's forward, skipped for the rows the feature cache
  serves) + b · (6 · drafter parameters + 4 · H · V) (the drafter's forward and backward, and the frozen LM
  head's forward and backward to its input), with b = block tokens per context token (num_anchors · B / seq_len)
  and drafter parameters as recipe/memory.py counts them.
- achieved FLOP/s ∝ 1 + WIDTH_EFFICIENCY · ln(H / 576) for H in [576, 4096]: narrow matmuls use the GPU less.

Fitted on one H200, steady-state context tokens a second (`train_tok_per_s`), B = 8, 512 anchors, 8 rows of
4,096 tokens: SmolLM2-135M (H 576, V 49,152) 600.2K with the cache serving 78 % of the rows
(benchmarks/results/recipe-smollm2-onpolicy-full_h200_2026-12-02.json), and a Qwen3-8B shape (H 4,096) at
20.9K with no cache (../shared/FIELD_NOTES.md: target forward 255.2 ms and drafter step 60.2K tok/s for one
8,192-token row at B = 16, b = 1). Checked against: Gemma 3 270M (H 640, V 262,144) measured 201.6K, predicted
224K; Qwen2.5-Coder-0.5B (H 896, V 151,936) measured 207.1K, predicted 250K
(benchmarks/results/recipe-{gemma3-270m,qwen2.5-coder-0.5b}_h200_2026-12-02.json). The rule it replaces,
(576 / H)², predicted 486K and 248K.
"""

from __future__ import annotations

import math
from dataclasses import replace

from dflash_trainer.recipe.memory import TargetShape, drafter_params

SMOLLM2_SERVED = 0.78  # share of the rows the feature cache served in the SmolLM2 run the plan's rate comes from
SERVED_WHEN_CACHED = 0.87  # served share per cached share in the calibration runs (78 % served of 90 % cached: the
# first epoch computes every row)
WIDTH_EFFICIENCY = 0.92  # fitted: achieved FLOP/s 2.80 × SmolLM2's at H 4,096
MAX_WIDTH = 4096  # wider targets are taken at the 4,096 rate (none measured)


def served_share(cached_share: float) -> float:
    """The share of a run's rows the feature cache serves when it holds `cached_share` of them (0 … 1)."""
    return SERVED_WHEN_CACHED * min(1.0, max(0.0, cached_share))


def flops_per_token(shape: TargetShape, block_per_token: float, served: float) -> float:
    """Training FLOPs per context token (module docstring): the target forward on the rows not served by the
    cache, the drafter and its LM head on `block_per_token` block tokens."""
    drafter = 6 * drafter_params(shape) + 4 * shape.hidden * shape.vocab
    return (1 - served) * 2 * shape.params + block_per_token * drafter


def width_efficiency(hidden: int) -> float:
    """Achieved FLOP/s relative to a 576-wide model's: 1 + WIDTH_EFFICIENCY · ln(H / 576), H in [576, 4096]."""
    return 1 + WIDTH_EFFICIENCY * math.log(min(max(hidden, 576), MAX_WIDTH) / 576)


def is_reference(shape: TargetShape, reference: TargetShape) -> bool:
    """Whether `shape` is the measured `reference` target, whatever its number of target features k (the
    measured rates stand for it) and however its parameters were counted (within 1 %: a folder's or a GGUF's
    config counts SmolLM2 at 134.48M, its known numbers at 134.5M)."""
    same = replace(shape, k=reference.k, params=reference.params) == reference
    return same and abs(shape.params / reference.params - 1) < 0.01


def step_time_ratio(shape: TargetShape, reference: TargetShape, block_per_token: float, cached_share: float) -> float:
    """A step of `shape` (its feature cache holding `cached_share` of the rows) over the same step of
    `reference` (SmolLM2 as measured, its cache serving SMOLLM2_SERVED), at `block_per_token` block tokens a
    context token: the ratio of FLOPs per token over the ratio of achieved rates. 1.0 for the reference shape
    (whatever its number of target features k: its measured rate stands)."""
    if is_reference(shape, reference):
        return 1.0
    ours = flops_per_token(shape, block_per_token, served_share(cached_share)) / width_efficiency(shape.hidden)
    ref = flops_per_token(reference, block_per_token, SMOLLM2_SERVED) / width_efficiency(reference.hidden)
    return ours / ref
