"""Named sections of the training step, for the profiler's time breakdown (telemetry/breakdown.py).

The step's code marks its parts with `with section(NAME):`. While a torch profiler records, a
section is a `record_function` range named `dflash/NAME`; otherwise it is a `nullcontext`: one
call that asks the autograd profiler whether it is on (no device work, no host sync, no event),
so the training step runs exactly as without the marks (tests/unit/test_step_breakdown.py checks
bit-identical losses and weights with the profiler on and off).

Ranges (in step order):
  target_layers    the target's forward: packed-row masks, decoder layers, feature copies
  target_labels    the target's greedy labels (chunked LM head + argmax)
  blocks           anchors, block layout (inputs, positions, labels, weights), feature dropout
  mask_build       the drafter's attention masks (flex BlockMask / dense)
  drafter_forward  fc + hidden_norm, the drafter's decoder layers, final norm
  lm_head_loss     the frozen LM head over the trained slots, log-softmax, loss and metric sums
  backward         `.backward()` of the step's loss (split by the forward section of each node)
  optimizer        gradient clip, the non-finite flag, AdamW step, zero_grad
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

SECTION_PREFIX = "dflash/"
RANGES = ("target_layers", "target_labels", "blocks", "mask_build", "drafter_forward", "lm_head_loss", "backward",
          "optimizer")


def section(name: str) -> ContextManager:
    """A profiler range `dflash/<name>` while a torch profiler records, else a no-op context.

    name: one of RANGES (assert: an unknown name would silently fall into "other")."""
    assert name in RANGES, name
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(SECTION_PREFIX + name)
    return nullcontext()
