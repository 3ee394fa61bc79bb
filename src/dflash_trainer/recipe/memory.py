"""What fits on the card: the recipe's memory rules, pure functions over numbers (no torch, no files),
each returning its size with the sentence that explains it. They use the bytes the tensors really take
(bf16 = 2 bytes):

- feature cache: a cached row holds seq_len · k · hidden · 2 bytes of target features plus its
  labels (seq_len · 8 bytes); the cache gets what the card leaves after a 10 % reserve (allocator,
  CUDA context) and the drafter step, rounded down to 4 GiB, and at most what the data's rows need.
- drafter step: target weights (params · 2) + drafter weights, grads and Adam moments (params · 16)
  + rows_per_step · (seq_len · vocab · 2 [the target's bf16 logits for labels] + max(seq_len,
  num_anchors · B) · 272 · hidden [activations; 272 calibrated on the H200's measured 124.4 GiB peak
  with 116 GiB cached at B = 8, 512 anchors: 4,096 block tokens a 4,096-token row]). All of the
  activation term is counted per block token, which errs high: part of it (the context's keys and
  values) grows with seq_len only.
- regeneration rows: the KV cache of one row is 2 · layers · kv_heads · head_dim · (prompt + new
  tokens) · 2 bytes; rows = the largest power of two whose KV caches fit in 75 % of the card less
  the target's weights and 2 GiB of step buffers (logits, prefill chunks), at most 4,096.
- eval batch: the same KV rule at (the longest prompt, eval's --max-prompt-tokens, + new tokens + one
  block) per turn, in the eval target's dtype, in half the card, at most 256 (eval's CUDA default); 1
  on CPU (batch-1 decoding is latency-bound there). The eval's target (and so its cache) is fp32 when
  its weights take at most a quarter of the card (exact lossless check).

Calibration (tests/unit/test_recipe_plan.py works each case by hand): SmolLM2-135M (H 576, 30
layers, 3 KV heads, head_dim 64, k 5, seq_len 4096) at B = 8 gets 2,048 rows and 116 GiB on a 141 GiB
H200 (measured: 124.4 GiB peak) and 1,024 rows and a 60 GiB cache on an 80 GiB H100 (measured: 66.9 GiB
peak, 2026-12-06). The default drafter is B = 16 (recipe/plan.py `BLOCK_SIZE`): its step is planned at 13.2 GiB, so the
caches are 112 GiB (141 GiB free; 108 at 139) and 56 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

GIB = 1024**3
ACT_BYTES_PER_HIDDEN = 272  # drafter-step activation bytes per token per hidden unit (calibrated, see above)
RESERVE = 0.10  # share of the card kept free for the allocator and the CUDA context
REGEN_SHARE = 0.75  # share of the card the regeneration's KV caches may take (less weights and buffers)
REGEN_BUFFERS_GIB = 2.0
EVAL_SHARE = 0.5
CACHE_STEP_GIB = 4  # the feature cache is sized in steps of this many GiB


@dataclass(frozen=True)
class TargetShape:
    """The target's numbers the sizing needs (hidden size, layers, KV heads, head dim, vocab rows,
    parameter count, k = target layers fed to the drafter)."""

    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: float
    k: int = 5


def feature_row_bytes(shape: TargetShape, seq_len: int) -> int:
    """Bytes of one cached row: features seq_len · k · hidden · 2 (bf16) + labels seq_len · 8."""
    return seq_len * shape.k * shape.hidden * 2 + seq_len * 8


def drafter_params(shape: TargetShape, num_layers: int = 5) -> float:
    """The drafter's trained parameters: per layer 4 · H² (attention) + 3 · H · 4H (MLP), plus the
    k · H → H feature projection (no embedding or LM head: those are the target's)."""
    h = shape.hidden
    return num_layers * (4 * h * h + 12 * h * h) + shape.k * h * h


def step_bytes(shape: TargetShape, seq_len: int, rows_per_step: int, block_tokens: Optional[int] = None) -> float:
    """Peak bytes of one co-located drafter step besides the cache (module docstring's rule). block_tokens:
    num_anchors · B of one row (None: seq_len, the calibrated B = 8, 512 anchors at 4,096)."""
    weights = shape.params * 2 + drafter_params(shape) * 16
    act_tokens = max(seq_len, block_tokens or seq_len)
    return weights + rows_per_step * (seq_len * shape.vocab * 2 + act_tokens * ACT_BYTES_PER_HIDDEN * shape.hidden)


def regen_row_bytes(shape: TargetShape, prompt_tokens: int, new_tokens: int, elem_bytes: int = 2) -> int:
    """KV cache bytes of one row: 2 (K and V) · layers · kv_heads · head_dim · tokens · elem_bytes (the
    cache is in the target's dtype: 2 for bf16, 4 for an fp32 eval)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * (prompt_tokens + new_tokens) * elem_bytes


def _pow2_floor(x: float) -> int:
    return 1 << int(math.floor(math.log2(x))) if x >= 1 else 0


def _gib(x: float) -> str:
    """GiB for a reason: one decimal, two below 1 GiB (a few rows' 0.04 GiB is not 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def cache_gib(free_gib: float, shape: TargetShape, seq_len: int, rows_per_step: int, rows: int,
              block_tokens: Optional[int] = None) -> tuple[float, str]:
    """(feature cache GiB, reason): min(what `rows` need, free · 0.9 − the step), 4 GiB steps."""
    step = step_bytes(shape, seq_len, rows_per_step, block_tokens) / GIB
    room = free_gib * (1 - RESERVE) - step
    need = rows * feature_row_bytes(shape, seq_len) / GIB
    room4 = max(0.0, math.floor(room / CACHE_STEP_GIB) * CACHE_STEP_GIB)
    if need <= room4:
        got = float(math.ceil(need))
        return got, (f"the data's {rows:,} rows need {_gib(need)} GiB ({feature_row_bytes(shape, seq_len) / 2**20:.2f} MiB "
                     f"a row), which fits in {room4:.0f} GiB")
    return room4, (f"{free_gib:.0f} GiB less a {RESERVE:.0%} reserve and the drafter step's {step:.1f} GiB, in 4 GiB "
                   f"steps; the data's {rows:,} rows would need {_gib(need)} GiB (the rest recomputed each epoch)")


def step_rows(free_gib: float, shape: TargetShape, seq_len: int, block_tokens: Optional[int] = None) -> tuple[int, str]:
    """(rows a step, reason): the measured recipe's 8 when that step takes at most half the usable card
    (the rest holds the feature cache), else the largest of 4, 2, 1 whose step fits in half, else in all of
    it. Raises ValueError when one row does not fit."""
    usable = free_gib * (1 - RESERVE)
    for share in (0.5, 1.0):
        for rows in (8, 4, 2, 1):
            step = step_bytes(shape, seq_len, rows, block_tokens) / GIB
            if step <= usable * share:
                why = "the measured recipe's 8 rows of seq_len tokens a step" if rows == 8 else (
                    f"{rows} rows: the step takes {step:.1f} GiB of {usable:.0f} usable (8 rows: "
                    f"{step_bytes(shape, seq_len, 8, block_tokens) / GIB:.1f} GiB)")
                return rows, why
    one = step_bytes(shape, seq_len, 1, block_tokens) / GIB
    raise ValueError(f"{free_gib:.0f} GiB: one drafter step of one row at seq_len {seq_len} takes {one:.1f} GiB of "
                     f"{usable:.1f} usable; lower data.seq_len (--set data.seq_len=N) or use a larger card")


def regen_rows(free_gib: float, shape: TargetShape, prompt_tokens: int, new_tokens: int,
               conversations: int) -> tuple[int, str]:
    """(rows of the continuous batch, reason): KV caches in 75 % of the card (module docstring)."""
    row = regen_row_bytes(shape, prompt_tokens, new_tokens)
    room = free_gib * REGEN_SHARE - shape.params * 2 / GIB - REGEN_BUFFERS_GIB
    rows = min(4096, _pow2_floor(room * GIB / row))
    why = (f"{row / 2**20:.1f} MiB of KV cache a row ({prompt_tokens}+{new_tokens} tokens): the largest power of two "
           f"in {room:.1f} GiB ({REGEN_SHARE:.0%} of {free_gib:.0f} GiB less weights and {REGEN_BUFFERS_GIB:.0f} GiB of "
           f"buffers), at most 4,096")
    if conversations < rows:
        rows = max(8, _pow2_floor(conversations))
        why += f"; no more than the {conversations:,} conversations"
    return max(rows, 8), why


def eval_batch(free_gib: float, shape: TargetShape, prompt_tokens: int, new_tokens: int,
               block: int = 16, dtype: str = "bfloat16") -> tuple[int, str]:
    """(turns decoded at once, reason): KV caches of the longest turn, in the eval target's dtype, in half
    the card, at most 256."""
    row = regen_row_bytes(shape, prompt_tokens, new_tokens + block, 4 if dtype == "float32" else 2)
    fit = _pow2_floor(free_gib * EVAL_SHARE * GIB / row)
    return max(1, min(256, fit)), (f"{row / 2**20:.1f} MiB of {dtype} KV cache a turn in {EVAL_SHARE:.0%} of "
                                   f"{free_gib:.0f} GiB, at most 256")


def eval_dtype(free_gib: float, shape: TargetShape) -> tuple[str, str]:
    """(the eval target's dtype, reason): float32 when its weights take at most a quarter of the card (the
    exact lossless check: speculative and plain decoding then agree token for token), else bfloat16."""
    fp32 = shape.params * 4 / GIB
    if fp32 <= free_gib / 4:
        return "float32", f"fp32 weights ({fp32:.1f} GiB) fit in a quarter of the card: the exact lossless check"
    return "bfloat16", f"fp32 weights ({fp32:.1f} GiB) exceed a quarter of the card"
