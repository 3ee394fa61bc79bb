"""The recipe's sizing rules (recipe/memory.py, recipe/plan.py) against hand-worked cases for the embedded SmolLM2-135M:
H 576, 30 layers, 3 KV heads, head_dim 64, vocab 49,152, 134.5M parameters, k 5, seq_len 4096."""

import pytest

from dflash_trainer.recipe.memory import GIB, TargetShape, feature_row_bytes, regen_row_bytes, step_bytes
from dflash_trainer.recipe.plan import MIXTURE_SMOLLM2, MIXTURE_SMOLLM2_LARGE, SMOLLM2_135M, DataSize, make_plan

S = SMOLLM2_135M


def test_bytes_per_row():
    # features 4096 · 5 · 576 · 2 = 23,592,960 B + labels 4096 · 8 = 32,768 B → 23,625,728 B = 22.53 MiB
    assert feature_row_bytes(S, 4096) == 23_625_728
    # KV: 2 · 30 · 3 · 64 · (1536 + 512) · 2 = 47,185,920 B = 45 MiB
    assert regen_row_bytes(S, 1536, 512) == 47_185_920
    # step: 134.5M · 2 + drafter (5 · 16 · 576² + 5 · 576² = 28.2M) · 16 = 0.720 GB;
    # B = 8, 512 anchors (4,096 block tokens a row, = seq_len): 8 · 4096 · (49,152 · 2 + 272 · 576) = 8.355 GB;
    # total 9.075e9 B = 8.45 GiB
    assert step_bytes(S, 4096, 8) / GIB == pytest.approx(8.45, abs=0.01)
    assert step_bytes(S, 4096, 8, 4096) == step_bytes(S, 4096, 8)
    # B = 16, 512 anchors: 8,192 block tokens a row: 8 · (4096 · 49,152 · 2 + 8192 · 272 · 576) = 13.489 GB;
    # + 0.720 GB = 14,209,097,024 B = 13.23 GiB
    assert step_bytes(S, 4096, 8, 8192) == pytest.approx(14_209_097_024, rel=1e-6)


def test_h200_141_gib():
    p = make_plan(141, S, MIXTURE_SMOLLM2)
    assert p.block_size == 16 and "drafter.block_size=16" in p.train_sets and "loss.num_anchors=512" in p.train_sets
    # cache: 141 · 0.9 − 13.23 (B = 16) = 113.67 → 112 (4 GiB steps) < the data's 5,886 rows · 22.53 MiB = 129.5 GiB;
    # at 139 GiB free: 125.1 − 13.23 = 111.87 → 108
    assert make_plan(139, S, MIXTURE_SMOLLM2).feature_cache_gib == 108
    assert p.feature_cache_gib == 112
    # B = 8 (the measured recipe): 141 · 0.9 − 8.45 = 118.45 → 116
    assert make_plan(141, S, MIXTURE_SMOLLM2, block_size=8).feature_cache_gib == 116
    # rows: 141 · 0.75 − 0.25 (weights) − 2 = 103.5 GiB / 45 MiB = 2,355 → 2,048
    assert p.regen_batch_rows == 2048
    assert p.eval_batch == 256 and p.steps == 6000
    # regeneration: 118,180 turns · 136 tokens = 16.07M at 44.6K ÷ 0.83 = 53,735 tok/s (the measured H100 stage
    # over the two cards' ratio) = 299.1 s; its cap is twice that, so a run as fast as the estimate is never cut:
    # 598 s (SmolLM2 at the measured rows: recipe/regen_time.py's ratio is 1)
    assert p.regen_max_seconds == 598 and p.stage_seconds["regenerate"] == pytest.approx(299.1, abs=0.1)
    assert "H100 ÷ 0.83" in p.reasons["time: regenerate"] and "H200" in p.reasons["time: train"]
    # eval: fp32 weights 134.5M · 4 B = 0.50 GiB ≤ 141 / 4 → the exact (fp32) check; held-out 256 × 2 turns
    assert (p.eval_dtype, p.heldout_max_prompts, p.heldout_max_turns) == ("float32", 256, 2)
    # train: 6,000 steps · 8 · 4096 tokens at 511K tok/s = 384.8 s; B = 16 · 512 anchors = 2 · 4096 block tokens:
    # · (1 + 0.36 · (2 − 1)) = 523.3 s, + 30 s of start = 553.3 s
    assert p.stage_seconds["train"] == pytest.approx(553.3, abs=0.1)
    assert make_plan(141, S, MIXTURE_SMOLLM2, block_size=8).stage_seconds["train"] == pytest.approx(414.8, abs=0.1)
    # B = 16 at 256 anchors: B = 8's 4,096 block tokens, so B = 8's memory and time
    a256 = make_plan(141, S, MIXTURE_SMOLLM2, num_anchors=256)
    assert (a256.feature_cache_gib, round(a256.stage_seconds["train"], 1)) == (116, 414.8)
    assert "loss.num_anchors=256" in a256.train_sets and "drafter.block_size=16" in a256.train_sets
    # fewer block tokens than seq_len: B = 8 at 256 anchors = 2,048: 384.8 · (1 − 0.36 · 0.5) = 315.5 s + 30; the
    # memory rule keeps seq_len's activations (it never plans below the calibrated B = 8 step)
    small = make_plan(141, S, MIXTURE_SMOLLM2, block_size=8, num_anchors=256)
    assert small.stage_seconds["train"] == pytest.approx(345.5, abs=0.1) and small.feature_cache_gib == 116


def test_h100_80_gib():
    p = make_plan(80, S, MIXTURE_SMOLLM2)
    # cache: 80 · 0.9 − 13.23 = 58.77 → 56; at B = 8 80 · 0.9 − 8.45 = 63.55 → 60 (measured: 66.9 GiB peak of 80)
    assert p.feature_cache_gib == 56
    assert make_plan(80, S, MIXTURE_SMOLLM2, block_size=8).feature_cache_gib == 60
    # rows: 80 · 0.75 − 2.25 = 57.75 GiB / 45 MiB = 1,314 → 1,024 (known to fit)
    assert p.regen_batch_rows == 1024
    # 44.6K tok/s (the measured H100 stage, 1,024 rows: 15.94M tokens in 357.6 s) → 16.07M in 360.4 s; cap 721 s
    assert p.regen_max_seconds == 721 and p.stage_seconds["regenerate"] == pytest.approx(360.4, abs=0.1)
    # train: 6,000 · 8 · 4096 / (511K · 0.92, the measured H100 loop) = 418.2 s; · 1.36 (B = 16) = 568.8 + 30 s
    # (measured at B = 8: 420.2 s of loop, 429.8 s of stage)
    assert p.stage_seconds["train"] == pytest.approx(598.8, abs=0.1)
    assert make_plan(80, S, MIXTURE_SMOLLM2, block_size=8).stage_seconds["train"] == pytest.approx(448.2, abs=0.1)


def test_24_gib_card():
    p = make_plan(24, S, MIXTURE_SMOLLM2)
    # step rows: half of 24 · 0.9 is 10.8 GiB < 8 rows' 13.23; 4 rows: 0.720 + 4 · 1.686 GB = 6.95 GiB fit
    # cache: 21.6 − 6.95 = 14.65 → 12; rows: 24 · 0.75 − 2.25 = 15.75 GiB / 45 MiB = 358 → 256
    assert (p.rows_per_step, p.feature_cache_gib, p.regen_batch_rows) == (4, 12, 256)
    # eval in fp32 (0.5 GiB of weights ≤ 6 GiB), so is its cache: 2 · 30 · 3 · 64 · (2048 + 256 + 16) · 4 =
    # 106.9 MB a turn; 12 GiB / 106.9 MB = 120.5 → 64 (a bf16 cache would have taken 128)
    assert p.eval_dtype == "float32" and p.eval_batch == 64
    # 256 rows: recipe/regen_time.py's SmolLM2 step 3.0 + 256 · 0.030899 = 10.910 ms → 23,465 tok/s, over the
    # measured 1,024 rows' 29,561 = 0.79377 · 44,600 = 35,402 tok/s → 454.0 s; the cap 2 · 454.0 = 908 s
    assert p.regen_max_seconds == 908
    # 4 rows a step: 6,000 steps see half the measured recipe's tokens, and the plan says what matches them
    assert "at 4 rows a step they see 4/8 of its tokens (--steps 12000 sees as many)" in p.reasons["steps"]
    assert p.warnings == [] and p.reasons["regen_max_conversations"] == "every conversation of the data"


def test_a_card_whose_regeneration_outlasts_its_cap_says_how_much_it_answers():
    p = make_plan(4, S, MIXTURE_SMOLLM2)
    # rows: 4 · 0.75 − 0.25 (weights) − 2 = 0.75 GiB / 45 MiB = 17 → 16. recipe/regen_time.py: SmolLM2's step is
    # 30 · 0.1 = 3.0 ms + R · (0.01378 + 2.417e-11 · 134.5e6 + 6.019e-7 · 23,040 = 0.030899 ms): 16 rows 4,578.8
    # tok/s, the measured 1,024 rows 29,561 → 0.15489 · 44.6K = 6,908 tok/s; 118,180 turns · 136 tokens / 6,908
    # = 2,327 s: under the 1 h cap, no warning
    assert p.regen_batch_rows == 16 and p.regen_max_seconds == 3600 and p.warnings == []
    assert p.stage_seconds["regenerate"] == pytest.approx(2326.6, abs=0.5)
    # the larger mixture: 255,050 turns · 136 tokens / 6,908 = 5,021 s = 84 min against the 1 h cap: 72 %
    # (16 rows lie below the fit's 128: said so)
    p = make_plan(4, S, MIXTURE_SMOLLM2_LARGE)
    assert p.regen_batch_rows == 16 and p.regen_max_seconds == 3600
    assert p.warnings == ["the regeneration would need about 84 min for the whole data; its 60 min cap answers "
                          "about 72% of the conversations (a larger card or a smaller --spec mixture answers more); "
                          "SmolLM2's rate was measured at 1,024 rows, scaled to 16 by a fit of decode steps "
                          "(recipe/regen_time.py, fitted on 128–2,048 rows)"]
    assert p.reasons["regen_max_conversations"].startswith("the conversations its 3600 s cap reaches: about 72%")
    assert "at 1 row a step they see 1/8 of its tokens (--steps 48000" in p.reasons["steps"]
    # an 8B-shaped target on an 80 GiB card: 128 rows (288 MiB of KV cache a row in 80 · 0.75 − 15.3 − 2 = 42.7
    # GiB); its step 36 · 0.1 + 128 · (0.01378 + 2.417e-11 · 8.2e9 + 6.019e-7 · 147,456 = 0.30073) = 42.09 ms →
    # 3,041 tok/s, over SmolLM2's 29,561 at 1,024 rows = 0.10287 · 44,600 = 4,588 tok/s: the packaged mixture's
    # 16.07M tokens in 3,503 s (under the cap); the larger mixture's 34.69M in 7,560 s = 126 min: 48 %
    big = TargetShape(hidden=4096, layers=36, kv_heads=8, head_dim=128, vocab=151_936, params=8.2e9)
    p = make_plan(80, big, MIXTURE_SMOLLM2)
    assert p.regen_batch_rows == 128 and p.warnings == []
    assert p.stage_seconds["regenerate"] == pytest.approx(3503, abs=1)
    p = make_plan(80, big, MIXTURE_SMOLLM2_LARGE)
    assert p.regen_batch_rows == 128 and p.regen_max_seconds == 3600
    assert p.warnings[0].startswith("the regeneration would need about 126 min for the whole data; its 60 min cap "
                                    "answers about 48% of the conversations")
    assert p.warnings[0].endswith("tok/s is SmolLM2's measured rate scaled to this target's shape by a fit of "
                                  "random-weight targets' decode steps (recipe/regen_time.py), not measured on this "
                                  "target")
    # with --hours the cap is its share of the hours; more of them answers more; a chat file is --data
    p = make_plan(4, S, MIXTURE_SMOLLM2, hours=1.5, mixture_done=True)
    assert any("(a larger card, more --hours or a smaller --data answers more)" in w for w in p.warnings)
    # sampled answers keep their note in the reason
    p = make_plan(4, S, MIXTURE_SMOLLM2, samples=2)
    assert p.reasons["regen_max_conversations"].endswith("of the data at the estimated rate, 2 sampled answers each "
                                                          "(--regen-samples)")


def test_cache_is_at_most_what_the_data_needs():
    small = DataSize(conversations=1000, turns=2000, tokens=409_600)
    # 409,600 · 0.98 / 4096 = 98 rows · 22.53 MiB = 2.16 GiB → 3 GiB (rounded up)
    assert make_plan(141, S, small).feature_cache_gib == 3


def test_cpu_is_a_tiny_plan():
    p = make_plan(None, S, MIXTURE_SMOLLM2)
    assert p.device == "cpu" and p.regen_max_conversations == 200 and p.steps == 40
    assert p.block_size == 8 and "drafter.block_size=8" in p.train_sets
    b16 = make_plan(None, S, MIXTURE_SMOLLM2, block_size=16)  # the user's --set drafter.block_size
    assert b16.block_size == 16 and "drafter.block_size=16" in b16.train_sets
    assert p.eval_max_prompts == 1 and p.eval_batch == 1 and p.feature_cache_gib == 0
    assert p.eval_dtype == "auto" and p.heldout_max_prompts is None


def test_a_large_target_evaluates_in_bf16():
    big = TargetShape(hidden=4096, layers=36, kv_heads=8, head_dim=128, vocab=151_936, params=8.2e9)
    # fp32 weights 8.2e9 · 4 B = 30.5 GiB > 80 / 4 = 20 GiB → bf16; on 141 GiB: 30.5 ≤ 35.25 → fp32
    assert make_plan(80, big, MIXTURE_SMOLLM2).eval_dtype == "bfloat16"
    assert make_plan(141, big, MIXTURE_SMOLLM2).eval_dtype == "float32"
    # its eval time is SmolLM2's, and the plan says that this is a floor
    assert "not modelled" in make_plan(80, big, MIXTURE_SMOLLM2).reasons["time: eval"]
    assert "time: eval" not in make_plan(80, S, MIXTURE_SMOLLM2).reasons


def test_hours_set_the_steps_and_bad_values_are_refused():
    short, long = make_plan(141, S, MIXTURE_SMOLLM2, hours=0.5), make_plan(141, S, MIXTURE_SMOLLM2, hours=2)
    assert short.steps < long.steps and long.total_seconds() <= 2 * 3600 * 1.05
    assert make_plan(141, S, MIXTURE_SMOLLM2, steps=123).steps == 123
    with pytest.raises(ValueError):
        make_plan(141, S, MIXTURE_SMOLLM2, hours=0)
    with pytest.raises(ValueError, match="data.seq_len"):
        make_plan(1, S, MIXTURE_SMOLLM2)  # 1 · 0.9 = 0.9 GiB < one row's step, 0.72 + 1.686 GB = 2.24 GiB


def test_rows_per_step_shrink_to_fit_the_card():
    # 4 GiB: usable 3.6, half of it 1.8; B = 16: 1 row 0.72 + 1.686 GB = 2.24 GiB fits only in all of it;
    # B = 8: 2 rows 0.72 + 2 · 1.044 GB = 2.62 GiB fit in 3.6, 1 row 1.64 GiB in 1.8
    assert make_plan(4, S, MIXTURE_SMOLLM2).rows_per_step == 1
    assert make_plan(4, S, MIXTURE_SMOLLM2, block_size=8).rows_per_step == 1
    big = TargetShape(hidden=4096, layers=36, kv_heads=8, head_dim=128, vocab=151_936, params=8.2e9)
    # Qwen3-8B shape on 80 GiB (usable 72): weights 16.4 GB + drafter 1.43e9 · 16 = 39.3 GB (36.6 GiB); at B = 8
    # a row 4096 · (151,936 · 2 + 272 · 4096) = 5.80 GB (5.40 GiB): none fits in 36 GiB; 4 rows 58.2 GiB fit in 72
    p8 = make_plan(80, big, MIXTURE_SMOLLM2, block_size=8)
    assert p8.rows_per_step == 4 and p8.feature_cache_gib == 12
    # B = 16: a row 4096 · 151,936 · 2 + 8192 · 272 · 4096 = 10.37 GB (9.66 GiB): 4 rows 75.2 GiB > 72; 2 rows
    # 55.9 GiB fit, leaving 16.1 → 16 GiB of cache
    p = make_plan(80, big, MIXTURE_SMOLLM2)
    assert p.rows_per_step == 2 and p.feature_cache_gib == 16


def test_the_packaged_default_mixture_is_configs_mixture_smollm2():
    """The recipe carries configs/mixture-smollm2.yaml's spec (configs/ is not installed with the
    package): the two must say the same, setting for setting."""
    from pathlib import Path

    import yaml

    from dflash_trainer.recipe.inputs import DEFAULT_MIXTURE

    configs = Path(__file__).resolve().parents[2] / "configs" / "mixture-smollm2.yaml"
    assert yaml.safe_load(DEFAULT_MIXTURE) == yaml.safe_load(configs.read_text())


def test_a_shipped_spec_plans_on_its_measured_size_another_says_it_does_not(tmp_path, monkeypatch):
    """`--spec` sizes the plan: the shipped specs by their measured builds (KNOWN_MIXTURES, keyed by the build
    digest, so a copy under another name or with other weights is the same build); any other spec takes the
    packaged mixture's size and says so with the way to plan on its own."""
    from pathlib import Path

    import yaml

    from dflash_trainer.recipe.inputs import spec_data_size

    configs = Path(__file__).resolve().parents[2] / "configs"
    assert spec_data_size(None) == (MIXTURE_SMOLLM2, None)
    assert spec_data_size(str(configs / "mixture-smollm2.yaml")) == (MIXTURE_SMOLLM2, None)
    assert spec_data_size(str(configs / "mixture-smollm2-no-code.yaml")) == (MIXTURE_SMOLLM2, None)
    assert spec_data_size(str(configs / "mixture-smollm2-large.yaml")) == (MIXTURE_SMOLLM2_LARGE, None)
    data = yaml.safe_load((configs / "mixture-smollm2-large.yaml").read_text())
    data["sources"][1]["count"] = 1000  # another build
    other = tmp_path / "mine.yaml"
    other.write_text(yaml.safe_dump(data))
    size, warning = spec_data_size(str(other))
    assert size == MIXTURE_SMOLLM2 and f"--spec {other} is not a shipped mixture" in warning
    assert f"`recipe --spec {other} --until mixture --out RUN`, then `recipe --data RUN/prompts.jsonl" in warning
    # the large build's 255,050 turns · 136 tokens at the H200 rate (53,735 tok/s) = 645.5 s; cap twice that
    large = make_plan(141, S, MIXTURE_SMOLLM2_LARGE)
    assert large.regen_max_seconds == 1291 and large.stage_seconds["regenerate"] == pytest.approx(645.5, abs=0.1)
    # its build (203 s measured on 2 cores): 45 s + 480 s ÷ processes, against the packaged one's 30 + 240 ÷ processes
    from dflash_trainer.recipe import plan as plan_module

    monkeypatch.setattr(plan_module, "mixture_workers", lambda: 4)
    assert make_plan(141, S, MIXTURE_SMOLLM2_LARGE).stage_seconds["mixture"] == 45 + 480 / 4
    assert make_plan(141, S, MIXTURE_SMOLLM2).stage_seconds["mixture"] == 30 + 240 / 4
    assert make_plan(None, S, MIXTURE_SMOLLM2_LARGE).stage_seconds["mixture"] == 45 + 480 / 2  # CPU plan: 2 cores
    # the data size of samples keeps the build's cost (the mixture is built once)
    assert MIXTURE_SMOLLM2_LARGE.times(2).build_s == (45.0, 480.0)


def test_the_plan_does_not_depend_on_the_run_folder(tmp_path):
    """A rerun must plan the same steps (they are part of the train stage's key): a finished mixture
    record in the run folder changes nothing. The bug this prevents: --hours budgeting the mixture
    only while its record was missing, so a resumed recipe retrained from scratch."""
    import json
    import subprocess
    import sys

    def plan():
        out = tmp_path / "plan.json"
        r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "recipe", "--out", str(tmp_path / "run"),
                            "--plan", "--gpu-memory-gib", "141", "--hours", "1", "--plan-json", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(out.read_text())

    before = plan()
    (tmp_path / "run" / "stages").mkdir(parents=True)
    (tmp_path / "run" / "stages" / "mixture.json").write_text("{}")
    assert plan() == before and before["steps"] > 6000


def test_the_users_block_size_and_anchors_size_the_plan(tmp_path):
    """Prevents a plan sized for B = 16 while the user's --set trains another B (or anchors): the step's
    memory and time follow the block tokens, so the cache and the time per stage must follow the --set."""
    import json
    import subprocess
    import sys

    def plan(*sets):
        out = tmp_path / "plan.json"
        r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "recipe", "--out", str(tmp_path / "run"),
                            "--plan", "--gpu-memory-gib", "141", "--plan-json", str(out), *sets],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(out.read_text())

    assert (plan()["block_size"], plan()["feature_cache_gib"]) == (16, 112)
    b8 = plan("--set", "drafter.block_size=8")
    assert (b8["block_size"], b8["feature_cache_gib"]) == (8, 116) and "drafter.block_size=8" in b8["train_sets"]
    assert plan("--set", "num_anchors=256")["feature_cache_gib"] == 116  # the short name, as train takes it


def test_the_prepare_key_carries_the_prepare_format(monkeypatch):
    """Prevents a recipe rerun after a PREPARE_FORMAT_VERSION bump from keeping RUN/data (its key
    unchanged) and then failing in train on `--prepared` rows of the old format."""
    from types import SimpleNamespace

    from dflash_trainer.data import prepare_report
    from dflash_trainer.recipe.records import key_hash
    from dflash_trainer.recipe.stages import prepare_key

    ctx = SimpleNamespace(hashes={"regenerate": "r" * 64}, plan=SimpleNamespace(seq_len=128),
                          settings=SimpleNamespace(target=None, spec=None))
    key = prepare_key(ctx)
    assert key == {"regenerate": "r" * 64, "seq_len": 128, "target": "embedded smollm2-135m",
                   "prepare_format": prepare_report.PREPARE_FORMAT_VERSION}
    monkeypatch.setattr(prepare_report, "PREPARE_FORMAT_VERSION", prepare_report.PREPARE_FORMAT_VERSION + 1)
    assert prepare_key(ctx)["prepare_format"] == key["prepare_format"] + 1
    assert key_hash(prepare_key(ctx)) != key_hash(key)


def test_sampled_answers_scale_the_data_the_plan_sizes():
    """Two answers per conversation double the conversations, turns and tokens the plan sees: twice the
    regeneration estimate (its cap too); the steps stay as asked."""
    data = DataSize(conversations=60_000, turns=110_000, tokens=16_000_000)
    assert data.times(2) == DataSize(120_000, 220_000, 32_000_000, False)
    assert DataSize(10, 20).times(3) == DataSize(30, 60, None, False)
    one, two = (make_plan(139, SMOLLM2_135M, data, steps=100, samples=n) for n in (1, 2))
    assert two.stage_seconds["regenerate"] == pytest.approx(2 * one.stage_seconds["regenerate"])
    assert two.regen_max_seconds == pytest.approx(2 * one.regen_max_seconds, abs=1)
    assert two.steps == one.steps == 100 and "2 sampled answers each" in two.reasons["regen_max_conversations"]


def test_cpu_plan_caps_input_conversations_when_sampling():
    """regenerate's --max-conversations counts input records: the CPU plan's 200 answers are 100 inputs × 2
    samples or 50 × 4, with the same regeneration estimate as 200 greedy answers."""
    data = DataSize(conversations=1000, turns=1000)
    plans = {n: make_plan(None, SMOLLM2_135M, data, samples=n) for n in (1, 2, 4)}
    assert [plans[n].regen_max_conversations for n in (1, 2, 4)] == [200, 100, 50]
    assert plans[4].stage_seconds["regenerate"] == pytest.approx(plans[1].stage_seconds["regenerate"])
    assert make_plan(None, SMOLLM2_135M, DataSize(conversations=12, turns=12), samples=2).regen_max_conversations == 12


def test_steps_that_pass_over_small_data_many_times_warn_with_the_plan():
    # 409,600 tokens · 0.98 / 4,096 = 98 rows, 13 steps a pass at 8 rows a step; --steps 6000 = 461.5 passes > 10
    small = DataSize(conversations=1000, turns=2000, tokens=409_600)
    assert make_plan(141, S, small, steps=6000).warnings == [
        "6,000 steps (8 rows each) are about 461.5 passes over the data's 98 rows (more than 10): the drafter will learn "
        "them by heart; give more data, or fewer --steps"]
    # 1 row: a pass is one (padded) step, as the train stage counts it; the plan's least, 50 steps, is 50 passes
    one = make_plan(141, S, DataSize(conversations=2, turns=2, tokens=4_000))
    assert one.steps == 50 and one.reasons["steps"].startswith("the plan's least, 50 steps: 50.0 passes over the "
                                                              "data's 1 row (the measured recipe's 6,000 steps would "
                                                              "be 6,000.0 passes)")
    assert one.warnings == [
        "50 steps (1 row each) are about 50.0 passes over the data's 1 row (more than 10): the drafter will learn them "
        "by heart; give more data, or --steps below the plan's least, 50"]
    # the mixture: 6,000 · 8 / 5,886 rows = 8.2 passes, the measured recipe's: no warning
    assert make_plan(141, S, MIXTURE_SMOLLM2).warnings == []


def test_default_steps_shrink_to_nine_passes_over_small_data():
    """Without --steps or --hours, data too small for the measured 6,000 steps gets 9 passes over its rows (under
    the train stage's limit of 10, for the estimate's error), at least 50 steps; the reason says why and what the
    6,000 would have been."""
    # 4,096,000 tokens · 0.98 / 4,096 = 980 rows = 123 steps a pass at 8 a step; 9 passes = 1,107 (6,000 = 48.8)
    p = make_plan(141, S, DataSize(conversations=10_000, turns=20_000, tokens=4_096_000))
    assert p.steps == 1107 and p.warnings == []
    assert p.reasons["steps"] == ("9 passes over the data's 980 rows at 8 rows a step (the measured recipe's "
                                  "6,000 steps would be 48.8 passes); more data trains longer")
    assert "optim.max_steps=1107" in p.train_sets and "runtime.save_every=92" in p.train_sets
    # 98 rows: 9 passes of 13 steps = 117; 24 rows: 27, below the least of 50 (16.7 passes: the plan says so)
    assert make_plan(141, S, DataSize(conversations=1000, turns=2000, tokens=409_600)).steps == 117
    tiny = make_plan(141, S, DataSize(conversations=200, turns=400, tokens=100_300))
    assert tiny.steps == 50 and tiny.warnings[0].startswith("50 steps (8 rows each) are about 16.7 passes over the "
                                                            "data's 24 rows")
    # the mixture's 5,886 rows: 6,000 steps are 8.2 passes, under 10: the measured recipe unchanged
    assert make_plan(141, S, MIXTURE_SMOLLM2).steps == 6000


def test_data_size_estimates_the_tokens_after_the_regeneration(tmp_path):
    """A chat file's tokens are what the recipe will train on: its prompts (every message but the assistant's)
    at 4 bytes a token, plus 136 answer and 10 template tokens a user turn; the file's own answers do not
    count (the target rewrites them), so a prompts-only file and one with long answers plan the same rows."""
    import json

    from dflash_trainer.recipe.inputs import data_size

    prompts = tmp_path / "prompts.jsonl"
    answered = tmp_path / "answered.jsonl"
    sys_msg = {"role": "system", "content": "s" * 40}
    user = {"role": "user", "content": "u" * 400}
    prompts.write_text("\n".join(json.dumps({"messages": [sys_msg, user, user]}) for _ in range(3)) + "\n")
    answered.write_text("\n".join(json.dumps({"conversations": [
        {"from": "system", "value": "s" * 40}, {"from": "human", "value": "u" * 400}, {"from": "gpt", "value": "a" * 9000},
        {"from": "human", "value": [{"type": "text", "text": "u" * 400}]}]}) for _ in range(3)) + "\n")
    # 3 conversations · (40 + 2 · 400) bytes = 2,520 bytes = 630 tokens; 6 user turns · 146 = 876
    for f in (prompts, answered):
        d = data_size(str(f))
        assert (d.conversations, d.turns, d.tokens, d.estimated) == (3, 6, 630 + 876, True)
    # a broken line among them is left out, as regenerate skips it: the answers still do not count
    broken = tmp_path / "broken.jsonl"
    broken.write_text(answered.read_text() + "{not json\n")
    assert data_size(str(broken)).tokens == 630 + 876
    # nothing parses: each line a record, every byte prompt text (12 lines of 100 bytes + newlines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(("x" * 100 + "\n") * 12)
    d = data_size(str(bad))
    assert (d.conversations, d.turns, d.tokens) == (12, 12, 1212 // 4 + 12 * 146)
    # a line separator inside a JSON string (written raw, as ensure_ascii=False writes it) splits no record
    sep = tmp_path / "sep.jsonl"
    sep.write_text(json.dumps({"messages": [user]}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "a\u2028b" + "u" * 398}]}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert "\u2028" in sep.read_text(encoding="utf-8")
    d = data_size(str(sep))
    assert (d.conversations, d.turns, d.tokens) == (2, 2, (400 + 402) // 4 + 2 * 146)


def test_the_mixture_time_follows_the_cpus_but_the_steps_do_not(monkeypatch):
    """The mixture stage runs on every CPU (at most 16): its planned time is 30 s + 240 s ÷ processes
    (150 s on 2, 45 s on 16), but --hours budgets it at its 2-core time on any machine, so the steps (part
    of the train stage's key) are the same whichever host a run resumes on."""
    import dflash_trainer.recipe.plan as plan_mod

    plans = {}
    for cpus in (2, 16):
        monkeypatch.setattr(plan_mod, "mixture_workers", lambda c=cpus: c)
        plans[cpus] = make_plan(139, S, MIXTURE_SMOLLM2, hours=0.5)
    assert plans[2].stage_seconds["mixture"] == 150.0 and plans[16].stage_seconds["mixture"] == 45.0
    assert plans[2].steps == plans[16].steps and plans[2].regen_max_seconds == plans[16].regen_max_seconds
    assert plans[2].train_sets == plans[16].train_sets


def test_mixture_workers_are_the_cpus_up_to_the_specs_cap(monkeypatch):
    """The mixture stage gets one process per CPU of this process's affinity, at most the spec's cap on math
    workers (16), at least 1."""
    import os

    from dflash_trainer.data.mixture.spec import MAX_WORKERS
    from dflash_trainer.recipe.machine import mixture_workers

    for cpus, want in ((1, 1), (2, 2), (16, 16), (64, 16)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)), raising=False)
        assert mixture_workers() == want
    assert MAX_WORKERS == 16
