"""`speculation.json`, the export's sidecar (interop/speculation.py, docs/formats.md): the draft length
to serve per batch size from an eval's speedup table, or only the maximum B−1 without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_interop_export import LAYER_TYPES, META, random_drafter, target_modules, tiny_config
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.interop.checkpoint_files import save_checkpoint
from dflash_trainer.interop.speculation import read_speedup_eval, speculation_sidecar

ROW = {"batch_size": 64, "chosen_draft_length": 1, "chosen_speedup": 1.21, "chosen_predicted_speedup": 1.3,
       "full_draft_length": 3, "speedup": 0.95, "chosen_tau": 1.6, "chosen_lossless": True,
       "recommended_draft_length": 1, "recommended_speedup": 1.21, "plain_tokens_per_s": 900.0, "predicted": []}
EVAL = {"dataset": "mt-bench", "target": "smollm2-135m", "target_dtype": "bfloat16", "temperature": 0.0,
        "block_size": 4, "max_new_tokens": 256, "tau": 2.5,
        "speedup_table": [ROW, {**ROW, "batch_size": 1, "chosen_draft_length": 2, "chosen_speedup": 1.9,
                                "chosen_predicted_speedup": 2.2, "speedup": 2.1, "chosen_tau": 2.9,
                                "recommended_draft_length": 3, "recommended_speedup": 2.1}]}


def _checkpoint(tmp_path: Path) -> Path:
    cfg = tiny_config(LAYER_TYPES["all-full"])  # B = 4
    save_checkpoint(tmp_path / "ckpt", random_drafter(cfg, target_modules()).trainable_state_dict(), cfg, META)
    return tmp_path / "ckpt"


def _export(tmp_path: Path, *extra: str):
    return CliRunner().invoke(app, ["export", str(_checkpoint(tmp_path)), "--format", "zlab", "--out",
                                    str(tmp_path / "z"), "--no-read-target", *extra])


def test_without_an_eval_only_the_maximum_is_recorded(tmp_path):
    """No --speedup-from: the sidecar says B−1 = 3 is the most the drafter proposes, and nothing measured."""
    res = _export(tmp_path)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "z" / "speculation.json").read_text()) == {
        "format": "dflash-trainer/speculation", "version": 1, "block_size": 4, "max_draft_length": 3,
        "measured": False, "source": None, "by_batch_size": []}


def test_eval_table_becomes_the_draft_length_per_batch_size(tmp_path):
    """--speedup-from EVAL.json: one row per batch size (sorted), the chosen k and its measured and
    predicted speedups beside the full-k speedup, and the eval's settings by file name (no path of
    this machine): prevents recommending the full k where the eval measured a shorter one faster."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "eval.json").write_text(json.dumps(EVAL))
    res = _export(tmp_path, "--speedup-from", str(tmp_path / "runs" / "eval.json"))
    assert res.exit_code == 0, res.output
    side = json.loads((tmp_path / "z" / "speculation.json").read_text())
    assert side["measured"] is True and side["max_draft_length"] == 3
    fingerprint = side["source"].pop("drafter_weights_sha256")
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0
    # this eval names no drafter fingerprint (written before they were recorded): taken, not checked
    assert side["source"] == {"eval_json": "eval.json", "dataset": "mt-bench", "target": "smollm2-135m",
                              "target_dtype": "bfloat16", "temperature": 0.0, "block_size": 4, "max_new_tokens": 256,
                              "same_drafter": None}
    # batch 1: the prediction chose k = 2 (measured 1.9×), all drafts measured faster (2.1×): k = 3 is served
    assert side["by_batch_size"] == [
        {"batch_size": 1, "draft_length": 3, "speedup": 2.1, "predicted_draft_length": 2, "predicted_speedup": 2.2,
         "predicted_choice_speedup": 1.9, "full_draft_length": 3, "full_speedup": 2.1, "tau": 2.9, "lossless": True},
        {"batch_size": 64, "draft_length": 1, "speedup": 1.21, "predicted_draft_length": 1, "predicted_speedup": 1.3,
         "predicted_choice_speedup": 1.21, "full_draft_length": 3, "full_speedup": 0.95, "tau": 1.6,
         "lossless": True}]


@pytest.mark.parametrize("body,message", [
    (None, "no such file"),
    ("{not json", "not a JSON file"),
    ({"tau": 2.0}, "no speedup_table; rerun eval with --batch-sizes"),
    ({"speedup_table": [{"batch_size": 1, "speedup": 2.0}]}, "lack chosen_draft_length"),
    ({"speedup_table": [3, 4]}, "not a list of rows"),
    ({**EVAL, "drafter": "ckpt"}, "its drafter record is not an eval's"),
    ({**EVAL, "drafter": {"weights_sha256": 12}}, "drafter.weights_sha256 must be a 64-digit hex string"),
])
def test_bad_eval_files_are_refused_before_the_export(tmp_path, body, message):
    """A missing, non-JSON, table-less or pre-draft-length eval file exits 2 naming --speedup-from
    and the fix, and no folder is written."""
    path = tmp_path / "eval.json"
    if body is not None:
        path.write_text(body if isinstance(body, str) else json.dumps(body))
    res = _export(tmp_path, "--speedup-from", str(path))
    assert res.exit_code == 2 and "--speedup-from" in res.output and message in " ".join(res.output.split())
    assert not (tmp_path / "z").exists()


def test_eval_at_a_larger_block_is_refused(tmp_path):
    """An eval of B = 8 could recommend 7 drafts to a B = 4 drafter: refused, naming the flag."""
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({**EVAL, "block_size": 8}))
    with pytest.raises(ValueError, match="--speedup-from eval.json: measured at block size 8, above this drafter's 4"):
        speculation_sidecar(4, read_speedup_eval(path), "eval.json")


def test_eval_of_this_drafter_is_checked_and_another_drafters_refused(tmp_path):
    """The eval JSON names the drafter it measured by its weights fingerprint: the export of the same
    checkpoint records same_drafter true; the table of another drafter (one bf16 value changed) exits
    2 naming --speedup-from and both fingerprints' starts, and writes no folder."""
    from dflash_trainer.interop.checkpoint_files import load_checkpoint
    from dflash_trainer.interop.fingerprint import weights_fingerprint

    ckpt = _checkpoint(tmp_path)
    _, weights, _ = load_checkpoint(ckpt)
    mine = weights_fingerprint(weights)
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({**EVAL, "drafter": {"path": "ckpt", "weights_sha256": mine}}))
    res = CliRunner().invoke(app, ["export", str(ckpt), "--format", "zlab", "--out", str(tmp_path / "z"),
                                   "--no-read-target", "--speedup-from", str(path)])
    assert res.exit_code == 0, res.output
    source = json.loads((tmp_path / "z" / "speculation.json").read_text())["source"]
    assert source["drafter_weights_sha256"] == mine and source["same_drafter"] is True

    name = sorted(weights)[0]
    other = {**weights, name: weights[name].clone()}
    other[name].view(-1)[0] += 1.0
    theirs = weights_fingerprint(other)
    assert theirs != mine
    path.write_text(json.dumps({**EVAL, "drafter": {"path": "other", "weights_sha256": theirs}}))
    res = CliRunner().invoke(app, ["export", str(ckpt), "--format", "zlab", "--out", str(tmp_path / "z2"),
                                   "--no-read-target", "--speedup-from", str(path)])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "--speedup-from eval.json: measured with another drafter" in text
    assert theirs[:12] in text and mine[:12] in text
    assert not (tmp_path / "z2").exists()
