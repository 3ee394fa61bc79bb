"""The step time of another target (recipe/step_time.py) against the runs it was fitted on and checked
against: context tokens a second on one H200, B = 8, 512 anchors, 8 rows of 4,096 tokens."""

import math

import pytest

from dflash_trainer.recipe.memory import TargetShape
from dflash_trainer.recipe.plan import MIXTURE_SMOLLM2, SMOLLM2_135M, make_plan
from dflash_trainer.recipe.step_time import flops_per_token, served_share, step_time_ratio, width_efficiency

S = SMOLLM2_135M
SMOLLM2_TOK_S = 600.2e3  # benchmarks/results/recipe-smollm2-onpolicy-full_h200_2026-12-02.json, train_tok_per_s
GEMMA3_270M = TargetShape(hidden=640, layers=18, kv_heads=1, head_dim=256, vocab=262_144, params=268e6)
QWEN25_05B = TargetShape(hidden=896, layers=24, kv_heads=2, head_dim=64, vocab=151_936, params=494e6)
QWEN3_8B = TargetShape(hidden=4096, layers=36, kv_heads=8, head_dim=128, vocab=151_936, params=8.2e9)


def test_flops_and_width_rule_by_hand():
    # SmolLM2 drafter: 5 · 16 · 576² + 5 · 576² = 28,200,960 parameters; LM head 4 · 576 · 49,152 = 113,246,208
    d = 6 * 28_200_960 + 113_246_208
    assert flops_per_token(S, 1.0, 0.0) == pytest.approx(2 * 134.5e6 + d)
    assert flops_per_token(S, 2.0, 1.0) == pytest.approx(2 * d)  # every row served: no target forward
    assert width_efficiency(576) == 1.0 and width_efficiency(300) == 1.0
    assert width_efficiency(4096) == pytest.approx(1 + 0.92 * math.log(4096 / 576))
    assert width_efficiency(8192) == width_efficiency(4096)
    assert served_share(0.9) == pytest.approx(0.783) and served_share(2.0) == 0.87 and served_share(-1) == 0


def test_the_ratio_reproduces_the_runs_it_was_fitted_on_and_checked_against():
    assert step_time_ratio(S, S, 2.0, 0.1) == 1.0  # the measured target keeps its measured step
    assert step_time_ratio(TargetShape(**{**S.__dict__, "k": 4}), S, 2.0, 0.1) == 1.0  # at any k
    # the runs' caches served 77 % and 80 % of the rows (served = 0.87 × cached)
    rate = {name: SMOLLM2_TOK_S / step_time_ratio(shape, S, 1.0, served / 0.87)
            for name, shape, served in (("gemma", GEMMA3_270M, 0.77), ("qwen", QWEN25_05B, 0.80), ("8b", QWEN3_8B, 0))}
    assert rate["8b"] == pytest.approx(20.9e3, rel=0.01)  # fitted: 1 / (1/60.2K + 1/32.1K)
    assert rate["gemma"] == pytest.approx(201.6e3, rel=0.12)  # measured 201.6K (the (576/H)² rule: 486K)
    assert rate["qwen"] == pytest.approx(207.1e3, rel=0.22)  # measured 207.1K (the (576/H)² rule: 248K)


def test_the_plan_times_another_target_s_steps_by_the_ratio():
    """An 8B-shaped target on an H200 with the mixture: the SmolLM2 step (8 · 4,096 tokens at 511K tok/s, 1.36 ×
    at B = 16) times the ratio at its own cache's share, plus the train stage's 30 s."""
    plan = make_plan(141, QWEN3_8B, MIXTURE_SMOLLM2)
    rows_8b = math.ceil(24_600_000 * 0.98 / 4096)
    cached = plan.feature_cache_gib / (rows_8b * 4096 * (5 * 4096 * 2 + 8) / 2**30)
    step = plan.rows_per_step * 4096 / 511_000 * 1.36 * step_time_ratio(QWEN3_8B, S, 2.0, cached)
    assert plan.stage_seconds["train"] == pytest.approx(plan.steps * step + 30, rel=1e-6)
    smol = make_plan(141, S, MIXTURE_SMOLLM2)
    assert smol.stage_seconds["train"] == pytest.approx(6000 * 8 * 4096 / 511_000 * 1.36 + 30, rel=1e-6)


def test_another_target_s_regeneration_rate_is_said_to_be_unmeasured():
    """The regeneration's rate is measured for SmolLM2 only: another target's plan says its rate is SmolLM2's
    scaled to its shape by recipe/regen_time.py's fit, not measured on it; SmolLM2's plan says nothing of the
    kind."""
    plan = make_plan(141, QWEN3_8B, MIXTURE_SMOLLM2)
    assert ("tok/s is SmolLM2's measured rate scaled to this target's shape by a fit of random-weight targets' "
            "decode steps (recipe/regen_time.py), not measured on this target") in plan.reasons["regen_max_seconds"]
    # its warning, when the estimate outlasts the stage's cap (the larger mixture: 105 min against 60), says so too
    from dflash_trainer.recipe.plan import MIXTURE_SMOLLM2_LARGE

    assert any("not measured on this target" in w for w in make_plan(141, QWEN3_8B, MIXTURE_SMOLLM2_LARGE).warnings)
    assert "not measured" not in make_plan(141, S, MIXTURE_SMOLLM2).reasons["regen_max_seconds"]
    k4 = TargetShape(**{**S.__dict__, "k": 4})
    assert "not measured" not in make_plan(141, k4, MIXTURE_SMOLLM2).reasons["regen_max_seconds"]
    assert "not measured" in make_plan(141, QWEN3_8B, MIXTURE_SMOLLM2, hours=3).reasons["regen_max_seconds"]


def test_smollm2_counted_from_its_config_is_the_measured_reference():
    """A SmolLM2 folder or GGUF is counted from its config at 134,479,872 parameters (no norms), its known numbers
    say 134.5M: both are the measured target (its rates, no 'not measured' note); a 2 % larger one is not."""
    from dataclasses import replace

    from dflash_trainer.recipe.step_time import is_reference

    assert is_reference(replace(S, params=134_479_872.0), S)
    assert "not measured" not in make_plan(141, replace(S, params=134_479_872.0),
                                           MIXTURE_SMOLLM2).reasons["regen_max_seconds"]
    assert not is_reference(replace(S, params=S.params * 1.02), S)
