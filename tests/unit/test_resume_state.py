"""Which training states may continue a run: same config, same layout, same drafter count."""

from pathlib import Path

import pytest

from dflash_trainer.config import TrainConfig
from dflash_trainer.training.checkpoint import check_resumable

CFG = TrainConfig().model_dump()
F = Path("run/checkpoint-10")


def test_same_config_and_layout_resume():
    check_resumable({"config": CFG}, CFG, F, "colocated")  # no marker: written by the co-located run
    check_resumable({"config": CFG, "layout": "pipeline", "num_drafters": 3}, {**CFG, "target_procs": 5}, F,
                    "pipeline", 3)  # another target count is fine
    # the target's attention kernel changes rounding, not the math: a run may switch it on resume
    check_resumable({"config": {**CFG, "target_attention": "sdpa"}}, {**CFG, "target_attention": "flex"}, F, "colocated")
    # and checkpoints written before the setting existed resume too
    check_resumable({"config": {k: v for k, v in CFG.items() if k != "target_attention"}}, CFG, F, "colocated")


def test_target_attention_setting_is_checked():
    from dflash_trainer.config import load_config

    assert load_config().target_attention == "auto"
    assert load_config(sets=["target_attention=sdpa"]).target_attention == "sdpa"
    with pytest.raises(ValueError, match="target_attention"):
        load_config(sets=["target_attention=flash"])


@pytest.mark.parametrize("state, layout, drafters, message", [
    ({"config": {**CFG, "lr": 0.1}}, "colocated", None, "different config (lr: 0.1 → 0.0006)"),
    ({"config": CFG, "layout": "pipeline", "num_drafters": 2}, "colocated", None,
     "written by the pipeline run: resume it with the same --target-gpus/--drafter-gpus"),
    ({"config": CFG}, "pipeline", 2, "written by the co-located run: resume it without a process layout"),
    ({"config": CFG, "layout": "pipeline", "num_drafters": 2}, "pipeline", 3,
     "trained with 2 drafter ranks, this run has 3"),
])
def test_other_config_layout_or_drafter_count_is_refused(state, layout, drafters, message):
    with pytest.raises(ValueError) as info:
        check_resumable(state, CFG, F, layout, drafters)
    assert message in str(info.value) and str(F) in str(info.value)


def test_summaries_of_both_layouts_read_as_one_result():
    """Prevents the finished-run rule reading only the co-located summary: a process layout's
    summary.json (stopped_early, per-rank fields) gives the same RunResult fields, and a summary
    missing a field of RunResult (another version) is refused rather than guessed."""
    from dflash_trainer.training.finished import STOP_REQUEST, RunResult, result_from_summary

    base = {"steps": 4, "tokens": 1024, "wall_s": 3.0, "train_tok_per_s": 500.0, "first_loss": 5.0,
            "last_loss": 4.0, "validation": {}, "checkpoint": "run/checkpoint-final", "skipped_steps": 1}
    colocated = RunResult(**base, interrupted=None)
    assert result_from_summary(colocated.as_dict()) == colocated
    pipeline = {**base, "steps_this_run": 2, "stopped_early": False, "layout": {"num_drafters": 2}}
    assert result_from_summary(pipeline) == colocated
    assert result_from_summary({**pipeline, "stopped_early": True}).interrupted == STOP_REQUEST
    with pytest.raises(TypeError):
        result_from_summary({k: v for k, v in base.items() if k != "tokens"})
