"""The recipe's sizing rules (recipe/plan.py) against hand-worked cases for the embedded SmolLM2-135M:
H 576, 30 layers, 3 KV heads, head_dim 64, vocab 49,152, 134.5M parameters, k 5, seq_len 4096."""

import pytest

from dflash_trainer.recipe.plan import (GIB, MIXTURE_SMOLLM2, SMOLLM2_135M, DataSize, feature_row_bytes, make_plan,
                                        regen_row_bytes, step_bytes)

S = SMOLLM2_135M


def test_bytes_per_row():
    # features 4096 · 5 · 576 · 2 = 23,592,960 B + labels 4096 · 8 = 32,768 B → 23,625,728 B = 22.53 MiB
    assert feature_row_bytes(S, 4096) == 23_625_728
    # KV: 2 · 30 · 3 · 64 · (1536 + 512) · 2 = 47,185,920 B = 45 MiB
    assert regen_row_bytes(S, 1536, 512) == 47_185_920
    # step: 134.5M · 2 + drafter (5 · 16 · 576² + 5 · 576² = 28.2M) · 16 = 0.720 GB;
    # 8 · 4096 · (49,152 · 2 + 272 · 576) = 8.355 GB; total 9.075e9 B = 8.45 GiB
    assert step_bytes(S, 4096, 8) / GIB == pytest.approx(8.45, abs=0.01)


def test_h200_141_gib():
    p = make_plan(141, S, MIXTURE_SMOLLM2)
    # cache: 141 · 0.9 − 8.45 = 118.45 → 116 (4 GiB steps) < the data's 5,791 rows · 22.53 MiB = 127.4 GiB
    assert p.feature_cache_gib == 116
    # rows: 141 · 0.75 − 0.25 (weights) − 2 = 103.5 GiB / 45 MiB = 2,355 → 2,048
    assert p.regen_batch_rows == 2048
    assert p.eval_batch == 256 and p.steps == 6000


def test_h100_80_gib():
    p = make_plan(80, S, MIXTURE_SMOLLM2)
    # cache: 80 · 0.9 − 8.45 = 63.55 → 60 (48 is known to fit; 60 + 8.45 = 68.45 GiB peak of 80)
    assert p.feature_cache_gib == 60
    # rows: 80 · 0.75 − 2.25 = 57.75 GiB / 45 MiB = 1,314 → 1,024 (known to fit)
    assert p.regen_batch_rows == 1024


def test_24_gib_card():
    p = make_plan(24, S, MIXTURE_SMOLLM2)
    # cache: 24 · 0.9 − 8.45 = 13.15 → 12; rows: 24 · 0.75 − 2.25 = 15.75 GiB / 45 MiB = 358 → 256
    assert (p.feature_cache_gib, p.regen_batch_rows) == (12, 256)
    # eval: 2 · 30 · 3 · 64 · (2048 + 256 + 16) · 2 = 53.4 MB a turn; 12 GiB / 53.4 MB = 241 → 128
    assert p.eval_batch == 128


def test_cache_is_at_most_what_the_data_needs():
    small = DataSize(conversations=1000, turns=2000, tokens=409_600)
    # 409,600 · 0.98 / 4096 = 98 rows · 22.53 MiB = 2.16 GiB → 3 GiB (rounded up)
    assert make_plan(141, S, small).feature_cache_gib == 3


def test_cpu_is_a_tiny_plan():
    p = make_plan(None, S, MIXTURE_SMOLLM2)
    assert p.device == "cpu" and p.regen_max_conversations == 200 and p.steps == 40
    assert p.eval_max_prompts == 1 and p.eval_batch == 1 and p.feature_cache_gib == 0


def test_hours_set_the_steps_and_bad_values_are_refused():
    short, long = make_plan(141, S, MIXTURE_SMOLLM2, hours=0.5), make_plan(141, S, MIXTURE_SMOLLM2, hours=2)
    assert short.steps < long.steps and long.total_seconds() <= 2 * 3600 * 1.05
    assert make_plan(141, S, MIXTURE_SMOLLM2, steps=123).steps == 123
    with pytest.raises(ValueError):
        make_plan(141, S, MIXTURE_SMOLLM2, hours=0)
    with pytest.raises(ValueError):
        make_plan(4, S, MIXTURE_SMOLLM2)  # 4 · 0.9 = 3.6 GiB < the 8.45 GiB step


def test_the_packaged_default_mixture_is_configs_mixture_smollm2():
    """The recipe carries configs/mixture-smollm2.yaml's spec (configs/ is not installed with the
    package): the two must say the same, setting for setting."""
    from pathlib import Path

    import yaml

    from dflash_trainer.recipe.inputs import DEFAULT_MIXTURE

    configs = Path(__file__).resolve().parents[2] / "configs" / "mixture-smollm2.yaml"
    assert yaml.safe_load(DEFAULT_MIXTURE) == yaml.safe_load(configs.read_text())
