"""What a run, its prepare and eval write names no path of the machine that wrote them, and a run
folder moved elsewhere still resumes, reuses its prepared rows and loads for eval."""

import json
import shutil
from pathlib import Path

from tests.integration.tiny_run import make_chats, make_target, train_here


def _strings(value):
    """Every string inside a JSON value (keys excluded)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _machine_paths(folder: Path, root: Path) -> list[str]:
    """'file: value' for each string of a JSON file under `folder` that is absolute or names `root`."""
    bad = []
    for f in sorted(folder.rglob("*.json")):
        for s in _strings(json.loads(f.read_text())):
            if s.startswith("/") or str(root) in s:
                bad.append(f"{f.relative_to(folder)}: {s}")
    return bad


def test_a_moved_run_folder_resumes_reuses_its_rows_and_evaluates(tmp_path, monkeypatch):
    """Prevents records that hold the writer's absolute paths (train_config.json, checkpoint config,
    summary.json, prepare_report.json, eval JSON) and readers that need them: the run is written to
    an absolute --out with the target and data given relative to the working folder, moved, then
    resumed (its OUT/data reused, not prepared again) and evaluated from the new place."""
    from dflash_trainer.evaluation.run import run_eval
    from dflash_trainer.evaluation.settings import EvalSettings

    monkeypatch.chdir(tmp_path)
    make_target(tmp_path / "target")
    make_chats(tmp_path / "chats.jsonl", 40)
    first_out = tmp_path / "site-a" / "run"
    result, _ = train_here(first_out, Path("target"), None, max_steps=3, data=Path("chats.jsonl"))
    assert result.steps == 3
    assert _machine_paths(first_out, tmp_path) == []
    assert json.loads((first_out / "summary.json").read_text())["checkpoint"] == "checkpoint-final"
    assert json.loads((first_out / "train_config.json").read_text())["out"] == "."
    report = json.loads((first_out / "data" / "prepare_report.json").read_text())
    assert (report["data_path"], report["tokenizer_name"]) == ("chats.jsonl", "target")
    assert json.loads((first_out / "checkpoint-final" / "config.json").read_text())["dflash"]["target"] == "target"

    moved = tmp_path / "site-b" / "moved-run"
    moved.parent.mkdir()
    shutil.move(str(first_out), str(moved))
    result, text = train_here(moved, Path("target"), None, max_steps=5, data=Path("chats.jsonl"))
    assert result.steps == 5 and result.steps_this_run == 2 and "resumed from" in text
    assert f"(in {moved / 'data'})" in text  # the moved rows were reused, not prepared again
    assert result.checkpoint == str(moved / "checkpoint-final")
    assert _machine_paths(moved, tmp_path) == []

    r = run_eval(EvalSettings(drafter=str(moved / "checkpoint-final"), target="target", dataset="chats.jsonl",
                              max_prompts=1, max_new_tokens=8, json_out=str(moved / "eval.json"), device="cpu"))
    assert r["drafter"]["path"] == str(moved / "checkpoint-final")  # the caller's result keeps usable paths
    body = json.loads((moved / "eval.json").read_text())
    assert body["drafter"]["path"] == "checkpoint-final" and body["plot"] == "eval.png"
    assert body["target"] == "target" and body["drafter"]["target_at_training"] == "target"
    assert _machine_paths(moved, tmp_path) == []
