"""Failure and shutdown: a lost rank ends every rank quickly with one error; a stop request ends cleanly."""

import json
import os
import signal
import threading
import time

import pytest
from pipeline_helpers import tiny_config, tiny_source

from dflash_trainer.interop.checkpoint_files import load_checkpoint
from dflash_trainer.pipeline.launch import PipelineFailed, PipelineOptions, run_pipeline


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie no one reaped yet counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _after_first_log(run_dir, action) -> threading.Thread:
    """Call action(ranks) once metrics.jsonl has a record (training is under way)."""

    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = run_dir / "metrics.jsonl"
            if m.exists() and m.read_text().strip() and (run_dir / "ranks.json").exists():
                action(json.loads((run_dir / "ranks.json").read_text()))
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_killing_a_target_rank_ends_every_rank_with_one_error(tmp_path, capfd):
    """Prevents hangs on a lost peer and error floods: SIGKILL of the target mid-run → every rank
    exits non-zero within 60 s, no process is left, and the cause is printed exactly once."""
    cfg = tiny_config(tmp_path, rows_per_step=2, max_steps=100_000, target_procs=1, drafter_procs=2, log_every=1)
    killed = {}

    def kill(ranks):
        target = next(r for r in ranks if r["role"] == "target")
        killed.update(pid=target["pid"], t=time.monotonic(), pids=[r["pid"] for r in ranks])
        os.kill(target["pid"], signal.SIGKILL)

    watcher = _after_first_log(tmp_path / "run", kill)
    with pytest.raises(PipelineFailed) as info:
        run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    elapsed = time.monotonic() - killed["t"]
    watcher.join(1)
    assert info.value.exit_code == 1
    assert elapsed < 60, elapsed
    status = json.loads((tmp_path / "run" / "exit_status.json").read_text())
    assert status["0"]["how"] == "killed by signal 9 (SIGKILL)"
    assert all(s["exitcode"] != 0 for s in status.values()), status
    assert not [p for p in killed["pids"] if _alive(p)]
    err = capfd.readouterr().err
    assert err.count("killed by signal 9") == 1, err
    assert err.count("error:") == 1, err
    assert "rank 0 (target, cpu) died" in err
    assert "Traceback" not in err, err


def test_stop_request_drains_and_exits_cleanly(tmp_path):
    """Prevents hangs and lost work at shutdown: SIGTERM mid-run → drafters agree on a step, drain
    what was granted, targets get their stop credits, every rank exits 0, a checkpoint is written."""
    cfg = tiny_config(tmp_path, rows_per_step=2, max_steps=100_000, target_procs=2, drafter_procs=2, log_every=1)
    watcher = _after_first_log(tmp_path / "run", lambda ranks: os.kill(os.getpid(), signal.SIGTERM))
    result = run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    watcher.join(1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"] is True
    assert 1 <= result.steps < 100_000
    assert summary["drafter_replica_max_abs_diff"] == 0.0
    status = json.loads((tmp_path / "run" / "exit_status.json").read_text())
    assert all(s["exitcode"] == 0 for s in status.values()), status
    _, _, meta = load_checkpoint(tmp_path / "run" / f"checkpoint-{result.steps}")  # resumable, not final
    assert meta["step"] == result.steps


def test_an_error_in_one_rank_is_shown_once_and_stops_all(tmp_path, capfd):
    """Prevents error floods and hangs when a rank raises: target 0 cannot read --init-from → the
    user sees that one line once (exit code 2), the waiting drafters leave too."""
    cfg = tiny_config(tmp_path, rows_per_step=2, max_steps=4, target_procs=1, drafter_procs=2,
                      init_from=str(tmp_path / "missing-drafter"))
    with pytest.raises(PipelineFailed) as info:
        run_pipeline(cfg, options=PipelineOptions(target_source=tiny_source()))
    assert info.value.exit_code == 2
    err = capfd.readouterr().err
    assert err.count("error:") == 1 and "rank 0 (target, cpu)" in err and "missing-drafter" in err, err
    assert "Traceback" not in err
    status = json.loads((tmp_path / "run" / "exit_status.json").read_text())
    assert all(s["exitcode"] == 1 for s in status.values()), status
