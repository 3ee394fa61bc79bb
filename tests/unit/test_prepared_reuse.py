"""A run folder's own prepared rows (OUT/data) are reused only for the same chat file and data
settings: re-pointing a run at other data must prepare again, never train on the old rows."""

from __future__ import annotations

import json

from dflash_trainer.config.load import load_config
from dflash_trainer.data.prepare import PREPARE_FORMAT_VERSION
from dflash_trainer.training.run_data import same_source, warn_old_format


def _report(folder, data, **kw):
    folder.mkdir(parents=True, exist_ok=True)
    rep = {"data_path": str(data), "data_bytes": data.stat().st_size, "seq_len": 512, "seed": 0,
           "max_conversations": 600, "validation_fraction": 0.02, "enable_thinking": None,
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
    a.write_text('{"messages": [], "grown": true}\n')  # the same file, rewritten with other content
    assert not same_source(prepared, cfg)
    (prepared / "prepare_report.json").write_text("{not json")
    assert not same_source(prepared, cfg)


def test_rows_of_an_older_prepare_format_are_kept_with_a_warning(tmp_path):
    """Format 1 built multi-turn documents before the per-turn serving rule (data/serving.py). A run's
    own OUT/data of that format is kept (a resumed run must train on the rows it started with) and, like
    a `--prepared` folder of it, gets a warning naming the fix."""
    from rich.console import Console

    a = tmp_path / "a.jsonl"
    a.write_text('{"messages": []}\n')
    prepared = tmp_path / "run" / "data"
    _report(prepared, a, format_version=1)
    assert PREPARE_FORMAT_VERSION == 2
    assert same_source(prepared, load_config(None, {"data.chats": str(a)}))
    console = Console(record=True, width=400)
    warn_old_format(prepared, console)
    assert "prepared with format 1, today's is 2" in console.export_text()
    _report(prepared, a)
    console = Console(record=True, width=400)
    warn_old_format(prepared, console)
    assert console.export_text() == ""
