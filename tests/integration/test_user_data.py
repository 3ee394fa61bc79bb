"""`train --data FILE` prepares every conversation of the file (no cap of the CPU smoke run), prints how
many it read and kept, and warns at the start when its steps would pass over the rows too often."""

from __future__ import annotations

import io
import json

from rich.console import Console

from tests.integration.tiny_run import make_chats, make_target


def test_every_conversation_of_a_1500_conversation_file_is_read(tmp_path):
    from dflash_trainer.config.load import load_config
    from dflash_trainer.target_model.load import load_tokenizer
    from dflash_trainer.training.run_data import prepared_rows

    chats = make_chats(tmp_path / "chats.jsonl", 1500)
    target = make_target(tmp_path / "target")
    cfg = load_config(None, {"out": str(tmp_path / "run"), "target.path": str(target), "data.chats": str(chats),
                             "device": "cpu"}, ["seq_len=128"])
    console = Console(file=io.StringIO(), width=300)
    train, val = prepared_rows(cfg, lambda: load_tokenizer(str(target)), tmp_path / "run", console)
    report = json.loads((tmp_path / "run" / "data" / "prepare_report.json").read_text())
    assert report["conversations_read"] == 1500 and report["conversations_kept"] == 1500
    assert report["conversations_train"] + report["conversations_validation"] == 1500
    assert "1500 of 1500 conversations kept" in console.file.getvalue()
    assert len(train) + len(val) == report["rows_train"] + report["rows_validation"] > 0
    console = Console(file=io.StringIO(), width=300)  # read back (the same file and settings): said again
    prepared_rows(cfg, lambda: load_tokenizer(str(target)), tmp_path / "run", console)
    assert "1500 of 1500 conversations kept" in console.file.getvalue()


def test_a_small_file_with_many_steps_warns_at_the_start(tmp_path):
    from tests.integration.tiny_run import train_here

    chats = make_chats(tmp_path / "chats.jsonl", 33)
    target = make_target(tmp_path / "target")
    _, text = train_here(tmp_path / "run", target, None, "validation_fraction=0.1", "rows_per_step=4", max_steps=100,
                         data=chats)
    assert "passes over the" in text and "(more than 10)" in text
    assert "the validation split holds" in text
