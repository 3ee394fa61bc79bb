"""Multi-process shutdown and resume: a stop request writes a resumable checkpoint, and the resumed
run continues the uninterrupted run's loss sequence exactly (CPU, gloo)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from pipeline_helpers import tiny_config, tiny_source, write_cli_target
from test_pipeline_failures import _after_first_log, _alive

from dflash_trainer.pipeline.launch import PipelineOptions, run_pipeline
from tests.integration.tiny_run import make_chats
from dflash_trainer.training.checkpoint import load_step_checkpoint


def _losses(run_dir):
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in records}


def test_stop_then_resume_continues_the_uninterrupted_run(tmp_path):
    """Prevents lost or different work after preemption in the multi-process layout: SIGTERM at a
    step → exit 0 with checkpoint-{step} holding the training state; the same call resumes at that
    step and every later loss equals the uninterrupted run's."""
    steps = 40  # long enough that the stop lands mid-run even on a loaded machine (the watcher polls)
    full = tiny_config(tmp_path / "full", rows_per_step=2, max_steps=steps, target_procs=1, drafter_procs=2,
                       log_every=1, save_every=4)
    run_pipeline(full, options=PipelineOptions(target_source=tiny_source()))
    ref = _losses(tmp_path / "full" / "run")
    assert sorted(ref) == list(range(1, steps + 1))
    assert (tmp_path / "full" / "run" / f"checkpoint-{steps - 4}").is_dir()  # periodic, pruned to keep_last
    assert not (tmp_path / "full" / "run" / "checkpoint-4").exists()

    cut = tiny_config(tmp_path / "cut", rows_per_step=2, max_steps=steps, target_procs=1, drafter_procs=2,
                      log_every=1, save_every=4)
    run_dir = tmp_path / "cut" / "run"
    watcher = _after_first_log(run_dir, lambda ranks: os.kill(os.getpid(), signal.SIGTERM))
    first = run_pipeline(cut, options=PipelineOptions(target_source=tiny_source()))
    watcher.join(1)
    assert first.interrupted and 1 <= first.steps < steps
    stopped_at = first.steps
    _, state, _ = load_step_checkpoint(run_dir / f"checkpoint-{stopped_at}")
    assert state["layout"] == "pipeline" and state["progress"]["step"] == stopped_at
    assert not (run_dir / "checkpoint-final").exists()

    second = run_pipeline(cut, options=PipelineOptions(target_source=tiny_source()))
    assert second.interrupted is None and second.steps == steps  # absolute, as in the co-located run
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, steps + 1))  # metrics.jsonl continues from the resumed step
    for step in range(1, steps + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7), step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["drafter_replica_max_abs_diff"] == 0.0


def test_resume_from_another_layout_is_refused(tmp_path):
    """Prevents a silent non-exact continuation: a checkpoint of the co-located layout, or of another
    number of drafter ranks, is named and refused by the launcher before any rank starts, the run's
    records untouched (the CLI prints the message, exit 2)."""
    import torch

    cfg = tiny_config(tmp_path, rows_per_step=2, max_steps=4, target_procs=1, drafter_procs=1, log_every=1, save_every=2)
    run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoint-final"
    state = torch.load(ck / "training_state.pt", weights_only=False)
    state["layout"] = "colocated"
    torch.save(state, ck / "training_state.pt")
    records = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}  # exit_status.json, ranks.json too
    with pytest.raises(ValueError, match="co-located"):
        run_pipeline(cfg.updated({"max_steps": 6}), options=PipelineOptions(target_source=tiny_source()))
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == records

    state["layout"] = "pipeline"  # another drafter count: the micro-batches, hence the anchors, would differ
    torch.save(state, ck / "training_state.pt")
    with pytest.raises(ValueError, match="trained with 1 drafter ranks, this run has 2"):
        run_pipeline(cfg.updated({"max_steps": 6, "drafter_procs": 2}),
                     options=PipelineOptions(target_source=tiny_source()))
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == records


def test_sigterm_to_the_cli_launcher_exits_zero_and_leaves_no_process(tmp_path):
    """Prevents orphans and lost work when a scheduler sends SIGTERM to `dflash-train train` with a
    process layout: exit code 0, every rank process gone, a loadable checkpoint, and the same
    command resumes to the end (its run in this process: the config the CLI builds from the same
    file and flags, `run_pipeline`)."""
    cfg = tiny_config(tmp_path, rows_per_step=2, max_steps=100_000, target_procs=1, drafter_procs=2, log_every=1)
    body = cfg.model_dump()
    import yaml

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(body))
    write_cli_target(tmp_path / "target")
    cmd = [sys.executable, "-m", "dflash_trainer.cli.main", "train", "--config", str(tmp_path / "cfg.yaml"),
           "--target", str(tmp_path / "target")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        m = run_dir / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 2 and (run_dir / "ranks.json").exists():
            break
        time.sleep(0.1)
    pids = [r["pid"] for r in json.loads((run_dir / "ranks.json").read_text())]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert not [p for p in pids if _alive(p)]
    ckpts = sorted(run_dir.glob("checkpoint-*"))
    assert len(ckpts) == 1 and ckpts[0].name != "checkpoint-final", ckpts
    step = int(ckpts[0].name.split("-")[1])
    _, state, _ = load_step_checkpoint(ckpts[0])
    assert state["progress"]["step"] == step

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**body, "optim": {**body["optim"], "max_steps": step + 3}}))
    from dflash_trainer.config.load import load_config

    done = run_pipeline(load_config(str(tmp_path / "cfg.yaml"), {"target.path": str(tmp_path / "target")}, []))
    assert done is not None and done.steps == step + 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == step + 3 and summary["steps_this_run"] == 3 and not summary["stopped_early"]


def test_rerun_of_a_finished_run_does_nothing(tmp_path, capfd):
    """Prevents a finished process-layout command, run again, from preparing data, starting ranks,
    loading the target, training or overwriting its records (summary.json, provenance.json,
    metrics.jsonl, the checkpoint); a larger --max-steps still continues from checkpoint-final.
    The command leaves rows_per_step (rounded up to the drafter count) and --prepared (the launcher
    prepares into OUT/data) to the run, so the rule must compare the config as the run recorded it.
    The re-run of the finished run builds the command's config the way the CLI does (load_config
    with the same flags) and runs it in this process."""
    import io

    from rich.console import Console

    from dflash_trainer.config.load import load_config

    target = write_cli_target(tmp_path / "target")
    run_dir = tmp_path / "run"
    data = make_chats(tmp_path / "chats.jsonl", 40)
    sets = ["seq_len=128", "num_anchors=8", "num_layers=1", "block_size=4", "target_layer_ids=[0,2]"]

    def train(steps):
        return subprocess.run(
            [sys.executable, "-m", "dflash_trainer.cli.main", "train", "--out", str(run_dir), "--target", str(target),
             "--data", str(data), "--target-procs", "1", "--drafter-procs", "2", "--device", "cpu", "--log-every", "1",
             "--max-steps", str(steps), *[arg for s in sets for arg in ("--set", s)]],
            capture_output=True, text=True, timeout=300)

    def train_here(steps):
        """The same command's run in this process: (result, what the launcher printed)."""
        cfg = load_config(None, {"out": str(run_dir), "target.path": str(target), "data.chats": str(data), "target_procs": 1,
                                 "drafter_procs": 2, "device": "cpu", "log_every": 1, "max_steps": steps}, sets)
        console = Console(file=io.StringIO(), width=200)
        capfd.readouterr()
        result = run_pipeline(cfg, console)
        return result, console.file.getvalue() + capfd.readouterr().out

    first = train(2)
    assert first.returncode == 0, first.stdout + first.stderr
    assert json.loads((run_dir / "train_config.json").read_text())["optim"]["rows_per_step"] == 2
    assert "Loading weights" not in first.stderr  # the ranks inherit the quiet loader bars
    files = ["summary.json", "provenance.json", "metrics.jsonl", "train_config.json", "ranks.json",
             "exit_status.json", "checkpoint-final/model.safetensors", "checkpoint-final/training_state.pt"]
    before = {f: (run_dir / f).read_bytes() for f in files}

    again, out = train_here(2)
    assert again is not None and again.steps == 2
    text = " ".join(out.split())
    assert "already finished at step 2" in text, text
    assert "pipeline:" not in text and "data:" not in text  # no rank started, nothing prepared
    assert {f: (run_dir / f).read_bytes() for f in files} == before

    more, out = train_here(3)  # resumes from checkpoint-final: one step this run (the summary below)
    assert more is not None and more.steps == 3
    assert "already finished" not in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["steps_this_run"] == 1 and not summary["stopped_early"]


def test_resumed_summary_reports_the_whole_run(tmp_path):
    """Prevents a process layout's summary.json from reporting the last segment as the whole run after
    a resume: the checkpoint keeps every segment's seconds (as a co-located run's does), and the
    summary's wall_s and train_tok_per_s add them to the resumed segment's, which `*_this_run` give."""
    cfg = tiny_config(tmp_path, rows_per_step=2, max_steps=3, target_procs=1, drafter_procs=1, log_every=1)
    run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    first = json.loads((tmp_path / "run" / "summary.json").read_text())
    _, state, _ = load_step_checkpoint(tmp_path / "run" / "checkpoint-final")
    earlier = state["progress"]
    assert earlier["wall_seconds"] > 0 and 0 < earlier["train_seconds"] < earlier["wall_seconds"]
    assert first["wall_s"] == first["wall_s_this_run"] and first["steps_this_run"] == 3

    run_pipeline(cfg.updated({"max_steps": 5}), options=PipelineOptions(target_source=tiny_source()))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["steps_this_run"] == 2
    assert summary["tokens"] == 5 * 2 * 128 > earlier["tokens"] == 3 * 2 * 128
    assert summary["wall_s"] == pytest.approx(earlier["wall_seconds"] + summary["wall_s_this_run"], rel=1e-9)
    assert summary["wall_s"] > summary["wall_s_this_run"] > 0
    train_this = (summary["tokens"] - earlier["tokens"]) / summary["train_tok_per_s_this_run"]
    assert summary["train_tok_per_s"] == pytest.approx(summary["tokens"] / (earlier["train_seconds"] + train_this), rel=1e-6)
