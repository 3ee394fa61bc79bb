"""Never lose a run: kill -9 / SIGTERM / corrupted checkpoint / changed config, on a tiny CPU run.

The reference is one uninterrupted run; every interrupted-and-resumed run must reproduce its
per-step loss sequence exactly (CPU, same seed, same thread count). The CLI is what gets killed or
stopped; the reference and the resumes are the same command's run in this process (`train_here`:
no interpreter and library start-up), since what they test is what the interrupted run left on disk.
"""

import json
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch

from tests.integration.tiny_run import cli_env, make_prepared, make_target, run, train_cmd, train_here


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    target = make_target(d / "target")
    prepared = make_prepared(d / "prepared")
    ref = d / "reference"
    result, _ = train_here(ref, target, prepared)
    assert result.steps == 12 and result.interrupted is None
    return d, target, prepared, ref, _losses(ref)


def _losses(out):
    return [(rec["step"], rec["loss"]) for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def _wait_for_steps(out, n, proc, timeout=120):
    path, t0 = out / "metrics.jsonl", time.time()
    while time.time() - t0 < timeout:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"no {n} logged steps within {timeout} s")


def test_kill9_then_resume_reproduces_the_loss_sequence(setup):
    """Prevents lost or replayed data, optimizer or RNG state after a crash (exact resume)."""
    d, target, prepared, _, ref = setup
    out = d / "killed"
    kill_at = random.Random(1234).randint(4, 10)
    proc = subprocess.Popen(train_cmd(out, target, prepared), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env())
    _wait_for_steps(out, kill_at, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    result, text = train_here(out, target, prepared)  # train_cmd(out, ...) run again
    assert result.steps == 12 and "resumed from" in text
    assert _losses(out) == ref  # bitwise: same floats at every step, no step logged twice
    # the summary covers the whole run: the killed segment's time up to its last checkpoint counts
    resumed_at = 12 - result.steps_this_run
    assert resumed_at in (3, 6, 9) and result.wall_s > result.wall_s_this_run > 0 and result.train_tok_per_s > 0
    import io

    from rich.console import Console

    from dflash_trainer.training.finished import print_summary

    console = Console(file=io.StringIO(), width=200)
    print_summary(result, console)
    assert f"this run (resumed at step {resumed_at}): {12 - resumed_at} steps" in console.file.getvalue()


def test_sigterm_checkpoints_exits_zero_and_resumes(setup):
    """Prevents a preempted job losing its work: SIGTERM → checkpoint, exit 0, exact resume."""
    d, target, prepared, _, ref = setup
    out = d / "terminated"
    proc = subprocess.Popen(train_cmd(out, target, prepared), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env())
    _wait_for_steps(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout + stderr
    assert "stopped by SIGTERM" in stdout
    step = max(s for s, _ in _losses(out))
    state = torch.load(out / f"checkpoint-{step}" / "training_state.pt", weights_only=False)
    assert state["progress"]["step"] == step
    result, text = train_here(out, target, prepared)
    assert result.steps == 12 and f"at step {step}" in " ".join(text.split())
    assert _losses(out) == ref


def test_corrupted_newest_checkpoint_falls_back_to_previous(setup):
    """Prevents a truncated checkpoint (crash while writing, bad disk) from blocking the resume."""
    d, target, prepared, ref_dir, ref = setup
    out = d / "corrupted"
    shutil.copytree(ref_dir, out)
    w = out / "checkpoint-final" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    result, text = train_here(out, target, prepared)
    assert result.steps == 12
    text = " ".join(text.split())
    assert "checkpoint-final is unreadable" in text and "falling back" in text
    assert "resumed from" in text and "checkpoint-9 at step 9" in text
    assert _losses(out) == ref


def test_resume_with_another_config_is_refused(setup):
    """Prevents silently continuing a run under different settings."""
    d, target, prepared, ref_dir, _ = setup
    out = d / "otherconfig"
    shutil.copytree(ref_dir, out)
    with pytest.raises(ValueError) as e:  # the CLI prints this text as its one line, exit 2 (test_bad_input)
        train_here(out, target, prepared, "lr=0.1")
    assert "different config" in " ".join(str(e.value).split()) and "lr" in str(e.value)


def test_half_written_checkpoint_is_never_picked(setup):
    """Prevents resuming from a temporary folder left by a crash mid-write."""
    from dflash_trainer.training.checkpoint import step_checkpoints

    d, _, _, ref_dir, _ = setup
    out = d / "tmpleft"
    shutil.copytree(ref_dir, out)
    shutil.copytree(out / "checkpoint-9", out / ".checkpoint-12.tmp-abc")
    names = [p.name for _, p in step_checkpoints(out)]
    assert names[0] == "checkpoint-final" and all(not n.startswith(".") for n in names)


def test_resume_from_a_named_checkpoint_takes_exactly_that_one(setup):
    """Prevents `--resume run/checkpoint-3` silently continuing from the run's newest checkpoint."""
    from dflash_trainer.config.schema import TrainConfig
    from dflash_trainer.training.run import find_resume

    d, _, _, ref_dir, _ = setup
    cfg = TrainConfig(resume=str(ref_dir / "checkpoint-3"))
    folder, state, _ = find_resume(cfg, d / "unused", print)
    assert folder == ref_dir / "checkpoint-3" and state["progress"]["step"] == 3
    folder, state, _ = find_resume(cfg.updated({"resume": str(ref_dir)}), d / "unused", print)
    assert folder.name == "checkpoint-final" and state["progress"]["step"] == 12


def test_rerun_of_a_finished_run_does_nothing(setup):
    """Prevents a finished command, run again, from redoing validation and overwriting its records
    (summary.json with 0 tok/s, provenance.json, metrics.jsonl)."""
    d, target, prepared, ref_dir, _ = setup
    out = d / "finished"
    shutil.copytree(ref_dir, out)
    files = ["summary.json", "provenance.json", "metrics.jsonl", "train_config.json"]
    before = {f: (out / f).read_bytes() for f in files}
    r = run(train_cmd(out, target, prepared))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already finished at step 12" in " ".join(r.stdout.split())
    assert {f: (out / f).read_bytes() for f in files} == before
    assert "target:" not in r.stdout  # nothing was loaded


def test_finished_run_with_more_steps_trains_on(setup):
    """A larger --max-steps continues a finished run (not "already finished"), from its final
    checkpoint, and the new summary is the continuation's."""
    from dflash_trainer.config.schema import TrainConfig
    from dflash_trainer.training.run import finished_run

    d, target, prepared, ref_dir, _ = setup
    out = d / "more"
    shutil.copytree(ref_dir, out)
    cfg = json.loads((out / "train_config.json").read_text())
    assert finished_run(TrainConfig(**{**cfg, "out": str(out)})) is not None
    assert finished_run(TrainConfig(**{**cfg, "out": str(out), "max_steps": 14})) is None
    result, text = train_here(out, target, prepared, max_steps=14)  # train_cmd(..., "--max-steps", "14")'s run
    assert result.steps == 14 and result.interrupted is None
    text = " ".join(text.split())
    assert "already finished" not in text and "resumed from" in text
    assert json.loads((out / "summary.json").read_text())["steps"] == 14
