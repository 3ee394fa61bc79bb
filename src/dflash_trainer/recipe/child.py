"""One stage command as a child process: `python -m dflash_trainer.cli.main ARGS`, its output appended to
the stage's log; SIGTERM / SIGINT to the recipe are passed on to the child as SIGTERM, on which it stops as
it does when run by hand (training checkpoints first), and the recipe then stops without a finished record."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash_trainer.files.portable import RUN_ROOT_ENV


class StageFailed(RuntimeError):
    """A stage's command exited non-zero (or was stopped): stage, exit code, the log's last lines."""

    def __init__(self, stage: str, code: int, log: Path):
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        super().__init__(f"stage {stage} exited with {code} (log {log}):\n  " + "\n  ".join(tail))
        self.stage, self.code, self.log = stage, code, log


class Stopped(RuntimeError):
    """The recipe was asked to stop (SIGTERM / SIGINT) while a stage ran; its work so far stays on disk.
    `exit_code` is the shell's code for that signal, 128 + its number (143 SIGTERM, 130 SIGINT)."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


_stop_signal: list[int] = []
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def command(args: list[str]) -> list[str]:
    """The full argv of a `dflash-train` command run by this interpreter."""
    return [sys.executable, "-m", "dflash_trainer.cli.main", *args]


def child_env(run_root: Path | None = None) -> dict[str, str]:
    """The stages' environment: this one, unbuffered output, and PyTorch's expandable allocator segments unless
    PYTORCH_CUDA_ALLOC_CONF is set (the stages' tensor shapes vary: batches of turns, cache rows; fixed-size
    segments fragment, and the plan's memory rules were measured with expandable ones). `run_root`: the
    recipe's run folder, as RUN_ROOT_ENV, so that the stages' records name its files relative to themselves
    (files/portable.py: `../data` in RUN/drafter/train_config.json), not by this machine's path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if run_root is not None:
        env[RUN_ROOT_ENV] = os.path.abspath(run_root)
    return env


def run_child(stage: str, args: list[str], log: Path, heartbeat=None, run_root: Path | None = None) -> list[str]:
    """Run `dflash-train ARGS`, appending stdout and stderr to `log`; `heartbeat()` is called about once a
    second while it runs; `run_root`: the recipe's run folder (child_env). A SIGTERM or SIGINT to this
    process is passed on to the command as SIGTERM.
    Returns the lines the command wrote that start with `warning:` or `note:` (the recipe shows them: small
    data, skipped records, a busy CPU's thread advice). Raises StageFailed on a non-zero exit, Stopped when
    a signal stopped it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = log.stat().st_size if log.exists() else 0
    with log.open("a") as f:
        f.write(f"\n$ dflash-train {' '.join(args)}\n")
        f.flush()
        proc = subprocess.Popen(command(args), stdout=f, stderr=subprocess.STDOUT, env=child_env(run_root))

        def forward(signum, _frame):
            # passed on as SIGTERM, a stage's "stop and keep your work" (train checkpoints, regenerate keeps its
            # answers): a terminal's Ctrl-C reaches the child too (same process group), and a second SIGINT
            # would make train exit at once without its checkpoint
            _stop_signal.append(signum)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while proc.poll() is None:
                if heartbeat:
                    heartbeat()
                time.sleep(0.5)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if _stop_signal:
        name = signal.Signals(_stop_signal[-1]).name
        raise Stopped(f"stopped by {name} during {stage} (log {log}); run the same command to resume", _stop_signal[-1])
    if proc.returncode != 0:
        raise StageFailed(stage, proc.returncode, log)
    with log.open("rb") as f:
        f.seek(start)
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    plain = (ANSI.sub("", line).strip() for line in lines)  # FORCE_COLOR makes the child write escape codes
    return [line for line in plain if line.startswith(("warning:", "note:"))]
