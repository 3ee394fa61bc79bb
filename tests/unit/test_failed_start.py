"""A `train` that fails before its first checkpoint leaves no run folder, and never removes one
that existed before or that holds more than setup records (pipeline/failed_start.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.pipeline.failed_start import first_created, remove_failed_start, removed_if_start_fails


def _setup_records(out: Path) -> None:
    """What `train` writes before the target loads (start_run_records, the rows it prepares)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text("{}")
    (out / "provenance.json").write_text("{}")
    (out / "data" / "train").mkdir(parents=True, exist_ok=True)


def test_first_created_is_the_outermost_missing_folder(tmp_path):
    assert first_created(tmp_path) is None
    assert first_created(tmp_path / "a" / "b" / "run") == tmp_path / "a"
    assert first_created(tmp_path / "run") == tmp_path / "run"


def test_failed_start_removes_only_what_it_created(tmp_path):
    """Prevents a refused start leaving a folder that looks like a run (and whose data a later run
    could reuse), and the opposite bug: deleting a folder that held anything else."""
    out = tmp_path / "a" / "b" / "run"
    created = first_created(out)
    with pytest.raises(ValueError), removed_if_start_fails(out):
        _setup_records(out)
        raise ValueError("mask token used by the data")
    assert created is not None and not created.exists() and tmp_path.exists()

    for extra in ("checkpoint-3", "metrics.jsonl", "summary.json"):  # a run that got further: kept
        out = tmp_path / extra / "run"
        with pytest.raises(RuntimeError), removed_if_start_fails(out):
            _setup_records(out)
            (out / extra).mkdir()
            raise RuntimeError("later failure")
        assert (out / extra).exists(), extra

    out = tmp_path / "beside" / "run"  # something else appeared beside OUT in a folder this run made
    with pytest.raises(KeyboardInterrupt), removed_if_start_fails(out):
        _setup_records(out)
        (tmp_path / "beside" / "notes.txt").write_text("mine")
        raise KeyboardInterrupt
    assert (tmp_path / "beside" / "notes.txt").exists() and (out / "train_config.json").exists()

    existing = tmp_path / "existing"  # existed before the start: never touched
    existing.mkdir()
    with pytest.raises(ValueError), removed_if_start_fails(existing):
        _setup_records(existing)
        raise ValueError("bad target")
    assert (existing / "train_config.json").exists()
    assert not remove_failed_start(tmp_path / "nothing-here", tmp_path / "nothing-here")


def test_cli_train_that_fails_in_setup_leaves_no_run_folder(tmp_path, monkeypatch):
    """Prevents today's leftover: `train` with paths that pass the preflight but a setup that fails
    (here: the run raises after writing its records) exits 2 with the error and no OUT; a rerun into
    an earlier run's folder keeps it."""
    import dflash_trainer.training.run as run

    def failing_train(cfg, console):
        _setup_records(Path(cfg.out))
        raise ValueError("mask_token_id=5 occurs 3 times in the training rows")

    monkeypatch.setattr(run, "train", failing_train)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (target / "tokenizer.json").write_text("{}")
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"conversations": []}\n')
    args = ["--target", str(target), "--data", str(chats), "--device", "cpu"]
    r = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "runs" / "x"), *args])
    assert r.exit_code == 2 and "mask_token_id=5 occurs" in r.output, r.output
    assert not (tmp_path / "runs").exists()
    earlier = tmp_path / "earlier"
    _setup_records(earlier)
    r = CliRunner().invoke(app, ["train", "--out", str(earlier), *args])
    assert r.exit_code == 2 and (earlier / "train_config.json").exists()
