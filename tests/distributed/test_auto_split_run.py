"""`train --procs N`: the split measured on CPU in the launcher, shown by `--dry-run`, then trained
by the same code path as --target-procs/--drafter-procs (tiny models, gloo)."""

import json
import os
import statistics
import subprocess
import sys

import pytest
import yaml
from pipeline_helpers import colocated_run, tiny_config, tiny_source, write_cli_target

from dflash_trainer.pipeline.auto_split import choose_split, project_split
from dflash_trainer.interop.checkpoint_files import load_checkpoint
from dflash_trainer.pipeline.launch import PipelineOptions, run_pipeline


def test_dry_run_prints_rates_every_split_and_the_choice(tmp_path):
    """Prevents a dry run that guesses instead of measuring, hides candidates, or starts ranks:
    `--procs 3 --dry-run` prints one JSON document (rates > 0 measured on the run's rows, both
    splits with the projection the model gives for those rates, the choice = choose_split's, the
    chosen layout), the table on stderr, and writes nothing to OUT."""
    cfg = tiny_config(tmp_path, max_steps=3)
    fields = cfg.model_dump(exclude_unset=True)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(fields))  # rows_per_step left at its default
    target = write_cli_target(tmp_path / "target")
    r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "train", "--config", str(tmp_path / "cfg.yaml"),
                        "--target", str(target), "--procs", "3", "--dry-run"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    body = json.loads(r.stdout)
    split = body["auto_split"]
    m = split["measured"]
    assert m["target_tok_per_s"] > 0 and m["drafter_tok_per_s"] > 0 and m["timing"] == "host clock"
    assert (m["rows"], m["seq_len"], m["cpu_threads"]) == (1, 128, max(1, (os.cpu_count() or 1) // 3))
    assert 1 <= len(m["target_ms"]) <= 5 and 1 <= len(m["drafter_ms"]) <= 5
    assert m["target_tok_per_s"] == pytest.approx(128 / (statistics.median(m["target_ms"]) / 1e3))
    rt, rd = m["target_tok_per_s"], m["drafter_tok_per_s"]
    got = [(c["targets"], c["drafters"], c["rows_per_step"], c["projected_tok_per_s"], c["limited_by"])
           for c in split["candidates"]]
    want = [(t, 3 - t, 3 - t, *project_split(t, 3 - t, rt, rd)[2:]) for t in (1, 2)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[3] for g in got] == pytest.approx([w[3] for w in want]) and [g[4] for g in got] == [w[4] for w in want]
    chosen = choose_split(3, rt, rd).chosen
    assert (split["chosen"]["targets"], split["chosen"]["drafters"]) == (chosen.targets, chosen.drafters)
    assert split["chosen_flags"] == {"target_procs": chosen.targets, "drafter_procs": chosen.drafters}
    assert (body["world_size"], body["num_targets"], body["num_drafters"]) == (3, chosen.targets, chosen.drafters)
    assert body["rows_per_step"] == chosen.drafters and body["backend"] == "gloo"
    assert "<- chosen" in r.stderr and "limited by" in r.stderr
    assert not (tmp_path / "run").exists()


def test_auto_split_trains_the_chosen_split(tmp_path):
    """Prevents the measured split from running another path than an explicit one: `procs=3`
    measures, writes OUT/auto_split.json, and trains the split it chose; the weights equal the
    co-located run at that split's batch, and the layout the ranks ran is the chosen one."""
    cfg = tiny_config(tmp_path, num_rows=8, max_steps=3, procs=3)
    result = run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    assert result is not None and result.steps == 3
    run = tmp_path / "run"
    split = json.loads((run / "auto_split.json").read_text())
    layout = json.loads((run / "layout.json").read_text())
    d = split["chosen"]["drafters"]
    assert split["measured"]["target_tok_per_s"] > 0 and split["measured"]["drafter_tok_per_s"] > 0
    assert (layout["num_targets"], layout["num_drafters"], layout["rows_per_step"]) == (3 - d, d, d)
    saved = json.loads((run / "train_config.json").read_text())
    assert (saved["layout"]["procs"], saved["layout"]["target_procs"], saved["layout"]["drafter_procs"]) == (None, 3 - d, d)
    _, weights, _ = load_checkpoint(run / "checkpoint-final")
    ref, _ = colocated_run(cfg.updated({"rows_per_step": d, "procs": None}), 3)
    assert max((weights[k] - ref[k]).abs().max().item() for k in ref) < 1e-5
    # the same command again: finished, so nothing is measured, prepared or rewritten
    records = {f: (run / f).read_bytes() for f in ("auto_split.json", "summary.json", "train_config.json", "layout.json")}
    logged = []

    class Capture:
        def print(self, msg, **_kw):
            logged.append(str(msg))

    again = run_pipeline(cfg, console=Capture(), options=PipelineOptions(target_source=tiny_source()))
    assert again is not None and again.steps == 3
    assert any("already finished" in m for m in logged) and not any("measuring" in m for m in logged), logged
    assert {f: (run / f).read_bytes() for f in records} == records
