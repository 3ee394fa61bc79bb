"""Which training states may continue a run: same config, same layout, same drafter count."""

from pathlib import Path

import pytest

from dflash_trainer.config.schema import TrainConfig, saved_config
from dflash_trainer.training.checkpoint import RESUME_MUTABLE, check_resumable

CFG = saved_config(TrainConfig())
F = Path("run/checkpoint-10")


def with_(cfg: dict, **values) -> dict:
    """`cfg` (a saved config) with bare-named settings changed, as a saved config."""
    return saved_config(TrainConfig(**cfg).updated(values))


def without(cfg: dict, section: str, field: str) -> dict:
    """`cfg` without one setting (a checkpoint written before the setting existed)."""
    return {**cfg, section: {k: v for k, v in cfg[section].items() if k != field}}


def test_same_config_and_layout_resume():
    check_resumable({"config": CFG}, CFG, F, "colocated")  # no marker: written by the co-located run
    check_resumable({"config": CFG, "layout": "pipeline", "num_drafters": 3}, with_(CFG, target_procs=5), F,
                    "pipeline", 3)  # another target count is fine
    # the target's attention kernel changes rounding, not the math: a run may switch it on resume
    check_resumable({"config": with_(CFG, target_attention="sdpa")}, with_(CFG, target_attention="flex"), F, "colocated")
    # and checkpoints written before the setting existed resume too
    check_resumable({"config": without(CFG, "target", "target_attention")}, CFG, F, "colocated")


def test_a_flat_config_of_an_earlier_release_is_refused_naming_the_fix():
    """Prevents a checkpoint of the flat config layout (no format_version) resuming under guessed
    settings: it is refused naming the folder, a new --out and runtime.resume=never."""
    flat = {k: v for section in CFG.values() if isinstance(section, dict) for k, v in section.items()}
    with pytest.raises(ValueError, match=r"run/checkpoint-10 holds a flat config of an earlier release.*"
                                         r"start a new --out, or pass --set runtime.resume=never"):
        check_resumable({"config": {**flat, "out": "x"}}, CFG, F, "colocated")


def test_resume_mutable_names_settings():
    """Prevents a RESUME_MUTABLE entry that names no setting (a bare or stale name is never compared)."""
    from dflash_trainer.config.schema import resolve_key

    assert all(resolve_key(k) == k for k in RESUME_MUTABLE)


def test_target_attention_setting_is_checked():
    from dflash_trainer.config.load import load_config

    assert load_config().target.target_attention == "auto"
    assert load_config(sets=["target.target_attention=sdpa"]).target.target_attention == "sdpa"
    with pytest.raises(ValueError, match="target_attention"):
        load_config(sets=["target_attention=flash"])


@pytest.mark.parametrize("state, layout, drafters, message", [
    ({"config": with_(CFG, lr=0.1)}, "colocated", None, "different config (optim.lr: 0.1 → 0.0006)"),
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
    assert result_from_summary(pipeline) == RunResult(**base, interrupted=None, steps_this_run=2)
    assert result_from_summary({**pipeline, "stopped_early": True}).interrupted == STOP_REQUEST
    with pytest.raises(TypeError):
        result_from_summary({k: v for k, v in base.items() if k != "tokens"})


def _save_final(out: Path, saved: dict, layout_state: dict) -> None:
    """OUT/checkpoint-final of a 12-step run (a 1-layer drafter) whose state holds `layout_state` and the saved
    config `saved`, and OUT/train_config.json = `saved`."""
    import json

    import torch

    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.interop.checkpoint_files import save_checkpoint

    dc = DrafterConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, vocab_size=32, block_size=8, mask_token_id=31,
                       target_layer_ids=[0, 1], num_target_layers=2)
    state = {**layout_state, "progress": {"step": 12}, "optimizer": {}, "scheduler": {},
             "metrics": torch.zeros(3), "config": saved}
    save_checkpoint(out / "checkpoint-final", {"fc.weight": torch.zeros(8, 16)}, dc, {"step": 12}, state)
    (out / "train_config.json").write_text(json.dumps(saved, indent=2) + "\n")


def _run_refused_by_its_checkpoint(out: Path, layout: dict) -> dict[str, bytes]:
    """A finished run folder: train_config.json, summary.json, provenance.json and checkpoint-final
    whose saved config trained with position_weights=decay (not the default). Returns the bytes of
    its records."""
    import json

    old = saved_config(TrainConfig(out=str(out), position_weights="decay", **layout.get("config", {})))
    _save_final(out, old, layout["state"])
    (out / "summary.json").write_text(json.dumps({"steps": 12, "note": "the finished run's"}) + "\n")
    (out / "provenance.json").write_text("{}\n")
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_refused_resume_leaves_the_run_records_as_they_were(tmp_path):
    """Prevents a resume that is refused (here: a checkpoint trained with position_weights=decay,
    continued under the default dpace) from first rewriting train_config.json and deleting
    summary.json: the co-located train refuses, naming the field, before it writes anything."""
    from dflash_trainer.training.run import train

    out = tmp_path / "run"
    out.mkdir()
    before = _run_refused_by_its_checkpoint(out, {"state": {"layout": "colocated"}})
    cfg = TrainConfig(out=str(out), prepared=str(tmp_path / "no-rows"), device="cpu", max_steps=20)
    with pytest.raises(Exception) as refused:
        train(cfg)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "checkpoint-final"])
    assert refused.type is ValueError and "loss.position_weights: 'decay' → 'dpace'" in str(refused.value)


@pytest.mark.parametrize("flags", [{"target_procs": 1, "drafter_procs": 1}, {"procs": 2}])
def test_refused_resume_in_a_process_layout_starts_nothing_and_writes_nothing(tmp_path, flags):
    """The process layout (a given split and a measured one) refuses the same checkpoint in the
    launcher: no rows prepared, no rank started, no record written or removed."""
    from dflash_trainer.pipeline.launch import run_pipeline

    out = tmp_path / "run"
    out.mkdir()
    before = _run_refused_by_its_checkpoint(out, {"state": {"layout": "pipeline", "num_drafters": 1},
                                                  "config": {**flags, "rows_per_step": 1}})
    cfg = TrainConfig(out=str(out), prepared=str(tmp_path / "no-rows"), device="cpu", max_steps=20, **flags)
    with pytest.raises(Exception) as refused:
        run_pipeline(cfg, env={})
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "checkpoint-final"])
    assert refused.type is ValueError and "loss.position_weights: 'decay' → 'dpace'" in str(refused.value)


def test_resume_check_before_start_passes_what_resumes(tmp_path):
    """The early check refuses only what the full check refuses: the same checkpoint under its own
    objective passes, an automatic split's undecided rows_per_step is compared as saved, and a run
    without a checkpoint (or resume=never) has nothing to check."""
    from dflash_trainer.training.run import refuse_unresumable

    out = tmp_path / "run"
    out.mkdir()
    _run_refused_by_its_checkpoint(out, {"state": {"layout": "pipeline", "num_drafters": 2},
                                         "config": {"rows_per_step": 4}})
    ok = TrainConfig(out=str(out), position_weights="decay", rows_per_step=4)
    refuse_unresumable(ok, "pipeline", 2)
    refuse_unresumable(ok.updated({"rows_per_step": 1}), "pipeline", undecided=("rows_per_step",))
    with pytest.raises(ValueError, match="optim.rows_per_step: 4 → 1"):
        refuse_unresumable(ok.updated({"rows_per_step": 1}), "pipeline", 2)
    with pytest.raises(ValueError, match="trained with 2 drafter ranks"):
        refuse_unresumable(ok, "pipeline", 3)
    refuse_unresumable(TrainConfig(out=str(out), resume="never"), "colocated")
    refuse_unresumable(TrainConfig(out=str(tmp_path / "fresh")), "colocated")
    assert not (tmp_path / "fresh").exists()


def _old_style(cfg: TrainConfig) -> dict:
    """The saved config code before portable paths wrote: the nested dump with `out` and every path
    exactly as given (here absolute, inside the run folder)."""
    return {"format_version": 2, **cfg.model_dump()}


def _finished_folder(out: Path, saved: dict, checkpoint: str) -> None:
    """A finished 12-step colocated run in `out` recorded with the saved config `saved`: checkpoint-final,
    train_config.json and summary.json (naming `checkpoint`)."""
    import json

    _save_final(out, saved, {"layout": "colocated"})
    summary = {"steps": 12, "tokens": 96, "wall_s": 1.0, "train_tok_per_s": 96.0, "first_loss": 3.0, "last_loss": 2.0,
               "validation": {}, "checkpoint": checkpoint}
    (out / "summary.json").write_text(json.dumps(summary) + "\n")


def test_a_record_of_older_code_with_paths_as_given_still_resumes_and_counts_as_finished(tmp_path):
    """Prevents a run folder written before paths were portable (train_config.json and the checkpoint's
    state naming `/…/run/drafter.json`) from being refused on resume ("drafter.drafter_config:
    '/…/run/drafter.json' → 'drafter.json'") and re-trained after it had finished."""
    from dflash_trainer.config.schema import portable_saved
    from dflash_trainer.training.finished import finished_run

    out = tmp_path / "run"
    out.mkdir()
    cfg = TrainConfig(out=str(out), prepared=str(out / "data"), drafter_config=str(out / "drafter.json"),
                      chat_template=str(out / "t.jinja"), tau_dataset="mt-bench", max_steps=12)
    old = _old_style(cfg)
    assert old["drafter"]["drafter_config"] == str(out / "drafter.json")  # the hand-written old form
    assert portable_saved(old) == saved_config(cfg)  # what today's code writes for the same run
    check_resumable({"config": old}, saved_config(cfg), out / "checkpoint-12", "colocated")
    with pytest.raises(ValueError, match=r"drafter.drafter_config: 'other.json' → 'drafter.json'"):
        check_resumable({"config": {**old, "drafter": {**old["drafter"], "drafter_config": "other.json"}}},
                        saved_config(cfg), out / "checkpoint-12", "colocated")
    _finished_folder(out, old, str(out / "checkpoint-final"))
    done = finished_run(cfg)
    assert done is not None and (done.steps, done.checkpoint) == (12, str(out / "checkpoint-final"))
    assert finished_run(cfg.updated({"drafter_config": str(tmp_path / "elsewhere.json")})) is None


def test_a_path_written_inside_a_recipe_and_by_hand_is_one_path(tmp_path, monkeypatch):
    """Prevents the train command a recipe logged, rerun by hand, from re-validating a finished drafter (and the
    recipe then redoing it): inside a recipe train_config.json says `data.prepared: ../data` (files/portable.py
    RUN_ROOT_ENV), by hand the same config says RUN/data; both name RUN/data. A checkpoint resumes across the two
    as well; another prepared folder still differs."""
    from dflash_trainer.files.portable import RUN_ROOT_ENV
    from dflash_trainer.training.finished import finished_run

    run = tmp_path / "RUN"
    (run / "data").mkdir(parents=True)
    cfg = TrainConfig(out=str(run / "drafter"), prepared=str(run / "data"), tau_dataset="mt-bench", max_steps=12)
    monkeypatch.setenv(RUN_ROOT_ENV, str(run))
    in_recipe = saved_config(cfg)
    monkeypatch.delenv(RUN_ROOT_ENV)
    assert in_recipe["data"]["prepared"] == "../data" and saved_config(cfg)["data"]["prepared"] == str(run / "data")
    out = Path(cfg.out)
    check_resumable({"config": in_recipe}, saved_config(cfg), out / "checkpoint-12", "colocated")
    _finished_folder(out, in_recipe, "checkpoint-final")
    assert finished_run(cfg) is not None  # by hand, no RUN_ROOT_ENV: the recipe's record is this run
    (tmp_path / "other").mkdir()
    assert finished_run(cfg.updated({"prepared": str(tmp_path / "other")})) is None
