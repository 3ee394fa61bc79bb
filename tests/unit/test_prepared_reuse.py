"""A run folder's own prepared rows (OUT/data) are reused only for the same chat file and data
settings: re-pointing a run at other data must prepare again, never train on the old rows."""

from __future__ import annotations

import hashlib
import json

from dflash_trainer.config.load import load_config
from dflash_trainer.data.prepare_report import PREPARE_FORMAT_VERSION
from dflash_trainer.training.run_data import same_source


def _report(folder, data, **kw):
    """A complete report of today's format for the chat file `data` (kw: fields to override)."""
    folder.mkdir(parents=True, exist_ok=True)
    rep = {"data_path": str(data), "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "data_bytes": data.stat().st_size,
           "tokenizer_name": "tok", "tokenizer_vocab_size": 8, "tokenizer_fingerprint": "f" * 16,
           "transformers_version": "5.18.0", "chat_template_sha256": "c" * 64, "chat_template_source": "tokenizer",
           "enable_thinking": None, "seq_len": 512, "seed": 0, "validation_fraction": 0.02, "max_conversations": None,
           "long_documents": "split", "pad_id": 0, "conversations_read": 1, "conversations_kept": 1,
           "conversations_skipped": 0, "skipped_by_reason": {}, "skip_examples": {},
           "leading_assistant_turns_dropped": 0, "trailing_turns_dropped": 0, "conversations_train": 1,
           "conversations_validation": 0, "validation_ids": [], "train": {}, "validation": {}, "rows_train": 1,
           "rows_validation": 0, "tokens": 1, "supervised_tokens": 1, "padding_fraction": 0.0,
           "format_version": PREPARE_FORMAT_VERSION, **kw}
    (folder / "prepare_report.json").write_text(json.dumps(rep))


def test_reuse_only_for_the_same_file_and_settings(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"messages": []}\n')
    b.write_text('{"messages": [], "x": 1}\n')
    prepared = tmp_path / "run" / "data"
    _report(prepared, a)
    cfg = load_config(None, {"data.chats": str(a)})
    assert same_source(prepared, cfg)
    assert not same_source(prepared, load_config(None, {"data.chats": str(b)}))  # another file
    assert not same_source(prepared, cfg.updated({"seq_len": 1024}))
    assert not same_source(prepared, cfg.updated({"validation_fraction": 0.1}))
    assert not same_source(prepared, cfg.updated({"enable_thinking": False}))
    a.write_text('{"messages": {}}\n')  # the same name and size (17 bytes), other bytes: only the sha256 differs
    assert a.stat().st_size == json.loads((prepared / "prepare_report.json").read_text())["data_bytes"] == 17
    assert not same_source(prepared, cfg)
    a.write_text('{"messages": []}\n')  # its bytes back: reused again
    assert same_source(prepared, cfg)
    a.write_text('{"messages": [], "grown": true}\n')  # the same file, rewritten with other content
    assert not same_source(prepared, cfg)
    (prepared / "prepare_report.json").write_text("{not json")
    assert not same_source(prepared, cfg)


def test_a_folder_of_another_prepare_format_is_refused_or_prepared_again(tmp_path):
    """One format per artifact: a report of another format_version is never read. A run's own
    OUT/data of it is prepared again (same_source is False); a `--prepared` folder of it is refused
    before anything loads, naming the fix."""
    import pytest
    from rich.console import Console

    from dflash_trainer.data.prepare_report import PrepareFormatMismatch, load_report
    from dflash_trainer.training.run_data import prepared_rows

    a = tmp_path / "a.jsonl"
    a.write_text('{"messages": []}\n')
    prepared = tmp_path / "run" / "data"
    _report(prepared, a)
    assert load_report(prepared).seq_len == 512
    _report(prepared, a, format_version=PREPARE_FORMAT_VERSION - 1)
    assert not same_source(prepared, load_config(None, {"data.chats": str(a)}))
    with pytest.raises(PrepareFormatMismatch, match=f"format {PREPARE_FORMAT_VERSION - 1}, this version reads "
                                                    f"format {PREPARE_FORMAT_VERSION}: run `dflash-train prepare` again"):
        load_report(prepared)
    cfg = load_config(None, {"data.prepared": str(prepared), "out": str(tmp_path / "r")})
    with pytest.raises(PrepareFormatMismatch):
        prepared_rows(cfg, lambda: None, tmp_path / "r", Console(record=True))
    _report(prepared, a, tokenizer_fingerprint=None)  # today's version, but a field missing or wrong
    with pytest.raises(ValueError, match="not a valid format-.*tokenizer_fingerprint"):
        same_source(prepared, load_config(None, {"data.chats": str(a)}))  # damaged: an error, never rebuilt silently
