"""How fast a target regenerates at a number of rows, relative to the measured SmolLM2 stage: the plan takes
SmolLM2's measured rate on the card's class (recipe/plan.py) and scales it by this module's ratio for any
other shape or number of rows.

The ratio compares decode rates, rows / step time, with one step of R rows of the continuous batch taking

    step_ms = PER_LAYER_MS · layers + R · (PER_ROW_MS + PER_ROW_PARAM_MS · params + PER_ROW_KV_MS · kv_bytes)

- layers: per-layer launch and attention set-up, paid once a step whatever the rows;
- per row: sampling and bookkeeping (PER_ROW_MS), the forward's FLOPs (prompt prefill included, both grow with
  the parameters) and the attention's read of the row's KV cache (kv_bytes = the KV cache bytes of one token,
  2 · layers · kv_heads · head_dim · 2 in bf16).

Fitted (least squares on relative error) on one 80 GiB H100, 2026-12-07, `dflash-train bench regen-shapes`:
random-weight targets of four shapes (SmolLM2-135M, Qwen2.5-0.5B, Qwen3-1.7B, Qwen3-8B) at 128 rows and at the
plan's rows (1,024, 2,048, 128, 128), prompts of 64–1,024 tokens, 128 new tokens each, 14 runs
(benchmarks/results/bench-regen-shapes_h100_2026-12-07.json). RMS error 9 %; with each shape left out of the
fit in turn, its runs are predicted within 17 % (one run, 25.7 ms where its three other runs took 17.9–18.3,
within 34 %). Rows below 128 (a small card's) are extrapolated: there the per-layer part dominates. The SmolLM2 rate it predicts at 1,024 rows, 29.6K tok/s, was close to the recipe's H100 stage
there before row attention (28.5K, real prompts and answers). A Qwen3-8B shape at its plan's 128 rows on the
H100 ran at 1/9.5 of SmolLM2 at 1,024 rows (the fit: 1/9.7); parameter-count scaling, the rule this replaces,
said 1/61. The fit was made with the regeneration's shared-span attention, before row attention became its
default: the plan applies it only as a ratio to SmolLM2's stage measured with row attention (44.6K tok/s on an
H100, recipe/plan.py), which assumes row attention speeds every shape and row count alike (not measured).
"""

from __future__ import annotations

from dflash_trainer.recipe.memory import TargetShape, regen_row_bytes

PER_LAYER_MS = 0.1000  # ms a step for each layer
PER_ROW_MS = 1.378e-2  # ms a step for each row
PER_ROW_PARAM_MS = 2.417e-11  # ms a step for each row and parameter
PER_ROW_KV_MS = 6.019e-7  # ms a step for each row and byte of one token's KV cache


def kv_bytes_per_token(shape: TargetShape) -> int:
    """Bytes of one token's KV cache in bf16: 2 (K and V) · layers · kv_heads · head_dim · 2."""
    return regen_row_bytes(shape, 1, 0)


def step_ms(shape: TargetShape, rows: int) -> float:
    """One decode step of `rows` rows of the continuous batch, ms (module docstring's fit, H100)."""
    per_row = PER_ROW_MS + PER_ROW_PARAM_MS * shape.params + PER_ROW_KV_MS * kv_bytes_per_token(shape)
    return PER_LAYER_MS * shape.layers + rows * per_row


def decode_rate(shape: TargetShape, rows: int) -> float:
    """Generated tokens a second at `rows` rows (every row writing a token each step), by the fit above."""
    return rows / step_ms(shape, rows) * 1e3


def regen_rate_ratio(shape: TargetShape, rows: int, reference: TargetShape, reference_rows: int) -> float:
    """The regeneration rate of `shape` at `rows` rows over that of `reference` (SmolLM2 as measured) at
    `reference_rows`, on the same card. 1.0 for the reference at its measured rows."""
    return decode_rate(shape, rows) / decode_rate(reference, reference_rows)
