"""The automatic target:drafter split as a pure choice, checked against splits worked by hand."""

import json

import pytest

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.pipeline.auto_split import (apply_split, auto_split_devices, choose_split, format_devices,
                                                project_split)
from dflash_trainer.pipeline.layout import parse_devices
from dflash_trainer.pipeline.split_probe import resume_drafter_count


def _row(choice, targets):
    return next(c for c in choice.candidates if c.targets == targets)


def test_eight_gpus_at_the_measured_h200_rates():
    """Prevents a wrong projection or a wrong winner. By hand, target 20K and drafter 57K tok/s per GPU,
    8 GPUs: t targets give 20K·t, d = 8 − t drafters 57K·d; 5+3 → min(100K, 171K) = 100K (target-bound),
    6+2 → min(120K, 114K) = 114K (drafter-bound), 7+1 → min(140K, 57K) = 57K. 6+2 wins at 114K."""
    choice = choose_split(8, 20_000, 57_000)
    assert [(c.targets, c.drafters) for c in choice.candidates] == [(t, 8 - t) for t in range(1, 8)]
    expected = {1: 20_000, 2: 40_000, 3: 60_000, 4: 80_000, 5: 100_000, 6: 114_000, 7: 57_000}
    assert {c.targets: c.projected_tok_per_s for c in choice.candidates} == pytest.approx(expected)
    assert (choice.chosen.targets, choice.chosen.drafters) == (6, 2)
    assert choice.chosen.projected_tok_per_s == pytest.approx(114_000) and choice.chosen.limited_by == "drafter"
    five = _row(choice, 5)
    assert (five.target_bound_tok_per_s, five.drafter_bound_tok_per_s, five.limited_by) == (100_000, 171_000, "target")
    # the default batch of 1 row becomes one row per drafter (layout_rows_per_step)
    assert [c.rows_per_step for c in choice.candidates] == [7, 6, 5, 4, 3, 2, 1]


def test_drafter_bottleneck_takes_all_but_one_device():
    """A fast target and a slow drafter (100 vs 10 tok/s, 4 devices): 1+3 → min(100, 30) = 30,
    2+2 → 20, 3+1 → 10; every split is drafter-bound and 1 target + 3 drafters wins."""
    choice = choose_split(4, 100, 10)
    assert [c.limited_by for c in choice.candidates] == ["drafter"] * 3
    assert (choice.chosen.targets, choice.chosen.drafters, choice.chosen.projected_tok_per_s) == (1, 3, 30)


def test_ties_go_to_more_targets():
    """Equal rates on 3 devices: 1+2 → min(10, 20) = 10 and 2+1 → min(20, 10) = 10 tie; the split with
    more targets (fewer drafters) is chosen. Within the 1 % tolerance still a tie (9.95 vs 10); at
    5 % apart the faster split wins."""
    choice = choose_split(3, 10, 10)
    assert [c.projected_tok_per_s for c in choice.candidates] == [10, 10]
    assert (choice.chosen.targets, choice.chosen.drafters) == (2, 1)
    near = choose_split(3, 10, 9.95)  # 1+2 → 10 (target-bound), 2+1 → 9.95 (drafter-bound)
    assert (near.chosen.targets, near.chosen.projected_tok_per_s) == (2, 9.95)
    apart = choose_split(3, 10, 9.5)
    assert (apart.chosen.targets, apart.chosen.projected_tok_per_s) == (1, 10)
    assert choose_split(3, 10, 9.95, tie_tolerance=0.0).chosen.targets == 1
    both = choose_split(2, 10, 10).chosen  # 1+1: both bounds are 10
    assert both.limited_by == "both" and both.projected_tok_per_s == 10


def test_ddp_efficiency_charges_two_or_more_drafters_only():
    """With efficiency 0.85 (20K / 57K, 8 GPUs): 6+2 → min(120K, 2·57K·0.85 = 96.9K) = 96.9K, 5+3 →
    min(100K, 145.35K) = 100K, so 5+3 wins; 7+1 keeps 57K (one drafter has no all-reduce)."""
    choice = choose_split(8, 20_000, 57_000, ddp_efficiency=0.85)
    assert _row(choice, 6).projected_tok_per_s == pytest.approx(96_900)
    assert _row(choice, 7).projected_tok_per_s == pytest.approx(57_000)
    assert (choice.chosen.targets, choice.chosen.projected_tok_per_s) == (5, pytest.approx(100_000))
    assert project_split(7, 1, 20_000, 57_000, 0.5)[1] == 57_000


def test_a_batch_the_user_set_must_split_over_the_drafters():
    """rows_per_step=3 set by the user on 8 GPUs: only 1 or 3 drafters can take it, so 6+2 (the
    winner at the default batch) is out and 5+3 runs at 100K; the default batch never rules one out."""
    choice = choose_split(8, 20_000, 57_000, rows_per_step=3, rows_per_step_set=True)
    feasible = [(c.targets, c.drafters) for c in choice.candidates if c.infeasible is None]
    assert feasible == [(5, 3), (7, 1)]
    assert "rows_per_step=3 does not split over 2 drafters" in _row(choice, 6).infeasible
    assert _row(choice, 6).projected_tok_per_s is None and "<- chosen" in choice.table()
    assert (choice.chosen.targets, choice.chosen.projected_tok_per_s) == (5, 100_000)
    assert choose_split(8, 20_000, 57_000, rows_per_step=3).chosen.rows_per_step == 4  # default: rounded up, 6+2


def test_a_resumed_run_keeps_its_drafter_count():
    """Prevents a re-run of the same `--gpus` command choosing another drafter count than its
    checkpoints (measurement noise), which the resume would refuse."""
    choice = choose_split(8, 20_000, 57_000, required_drafters=3)
    assert (choice.chosen.targets, choice.chosen.drafters) == (5, 3)
    assert "needs 3 drafters" in _row(choice, 6).infeasible
    with pytest.raises(ValueError, match="give at least 9 devices"):
        choose_split(8, 20_000, 57_000, required_drafters=8)


def test_choose_split_refuses_bad_input():
    for args, kw, msg in [((1, 10, 10), {}, "at least 2 devices"), ((4, 0, 10), {}, "target rate"),
                          ((4, 10, float("nan")), {}, "drafter rate"), ((4, 10, 10), {"ddp_efficiency": 1.5}, "(0, 1]")]:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("]", r"\]")):
            choose_split(*args, **kw)


def test_choice_serializes_to_json():
    body = json.loads(json.dumps(choose_split(8, 20_000, 57_000).as_dict()))
    assert len(body["candidates"]) == 7 and body["chosen"]["targets"] == 6 and "min(" in body["model"]


def test_devices_format_round_trips_and_the_split_becomes_layout_flags():
    for ids in ([0, 1, 2, 3, 4, 5], [6, 7], [0, 2, 5, 6], [3]):
        assert parse_devices(format_devices(ids), "--x") == ids
    assert format_devices([0, 1, 2, 5]) == "0-2,5"
    chosen = choose_split(8, 20_000, 57_000).chosen
    cfg = apply_split(TrainConfig(gpus="0-7"), [f"cuda:{g}" for g in range(8)], chosen)
    assert (cfg.layout.gpus, cfg.layout.target_gpus, cfg.layout.drafter_gpus) == (None, "0-5", "6-7")
    cfg = apply_split(TrainConfig(procs=3), ["cpu"] * 3, choose_split(3, 10, 10).chosen)
    assert (cfg.layout.procs, cfg.layout.target_procs, cfg.layout.drafter_procs) == (None, 2, 1)


def _flags(**kw):
    base = dict(gpus=None, procs=None, target_gpus=None, drafter_gpus=None, target_procs=None, drafter_procs=None,
                colocate=False, device="auto")
    return TrainConfig(**{**base, **kw})


def test_auto_split_flags_are_checked_with_the_fix():
    """Prevents a contradictory layout from being measured for minutes before it fails."""
    assert auto_split_devices(_flags(procs=3), env={}) == ["cpu"] * 3
    cases = [(_flags(gpus="0-7", target_gpus="0-4", drafter_gpus="5-7"), "drop --gpus to keep your split"),
             (_flags(procs=3, target_procs=1), "--procs measures and chooses the split, --target-procs"),
             (_flags(gpus="0-1", procs=2), "exclude each other"),
             (_flags(gpus="0"), "at least 2 GPUs"), (_flags(procs=1), "at least 2 processes"),
             (_flags(gpus="0-1", device="cpu"), "use --procs N"), (_flags(procs=2, colocate=True), "--colocate"),
             (_flags(gpus="1-0"), "expected GPU indices")]
    for cfg, msg in cases:
        with pytest.raises(ValueError, match=msg):
            auto_split_devices(cfg, env={})
    with pytest.raises(ValueError, match="under torchrun"):
        auto_split_devices(_flags(procs=2), env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                                 "LOCAL_WORLD_SIZE": "2"})


def test_resume_drafter_count_reads_the_run_folder(tmp_path):
    """The drafter count of OUT's checkpoints comes from OUT/layout.json, with no tensor loaded."""
    cfg = TrainConfig(out=str(tmp_path), procs=3)
    assert resume_drafter_count(cfg) is None  # nothing to resume
    (tmp_path / "checkpoint-4").mkdir()
    for name in ("config.json", "model.safetensors", "training_state.pt"):
        (tmp_path / "checkpoint-4" / name).write_bytes(b"")
    (tmp_path / "layout.json").write_text(json.dumps({"num_drafters": 2}))
    assert resume_drafter_count(cfg) == 2
    assert resume_drafter_count(cfg.updated({"resume": "never"})) is None
    other = TrainConfig(out=str(tmp_path / "new"), resume=str(tmp_path / "checkpoint-4"))
    assert resume_drafter_count(other) == 2
