"""The loaders' own progress bars (transformers "Loading weights", the GGUF converter) stay off
unless --verbose: drawn with `\\r`, each becomes one huge line in a log file."""

import os
import subprocess
import sys

from dflash_trainer.telemetry.library_bars import QUIET_ENV

from tests.integration.tiny_run import make_chats, make_prepared, make_target, run, train_cmd

BARS = ("Loading weights", "Saving the dataset", "de-quantizing", "it/s", "\r")
# torchao's import-time lines when it is installed (the fp8 extra) on a torch it was not built for
TORCHAO_NOISE = ("Failed to load", "is an Enum subclass")


def test_training_writes_no_loader_bars_by_default(tmp_path):
    """Prevents `train ... 2>&1 | tee log` filling the log with `\\r` bars of the target load and
    the data preparation (the run shows its own progress)."""
    target = make_target(tmp_path / "target")
    cmd = train_cmd(tmp_path / "run", target, tmp_path / "unused", "--max-steps", "1", "--set", "save_every=null",
                    "--data", str(make_chats(tmp_path / "chats.jsonl", 12)), "--set", "validation_fraction=0.2")
    i = cmd.index("--prepared")
    r = run(cmd[:i] + cmd[i + 2:])  # without --prepared: the run prepares (datasets) and loads (transformers)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "run" / "data" / "train").is_dir()  # the data was prepared by this run
    for bar in BARS + TORCHAO_NOISE:
        assert bar not in r.stderr and bar not in r.stdout, (bar, r.stderr)


def test_verbose_shows_the_loader_bars(tmp_path):
    """Prevents --verbose being accepted but not reaching the libraries."""
    target = make_target(tmp_path / "target")
    r = run(train_cmd(tmp_path / "run", target, make_prepared(tmp_path / "prepared", rows=2), "--max-steps", "1",
                      "--set", "save_every=null", "--verbose"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Loading weights" in r.stderr, r.stderr


def test_the_gguf_converter_bar_is_switched_off():
    """Prevents the GGUF load's "Converting and de-quantizing GGUF tensors..." bar, a plain tqdm bar
    that transformers' own switch does not reach, from printing (checked on the tqdm object that
    module draws with, instead of a 40 s load of the embedded GGUF)."""
    code = ("import sys; from dflash_trainer.telemetry.library_bars import set_library_bars; "
            "set_library_bars('-v' in sys.argv); import transformers.modeling_gguf_pytorch_utils as m; "
            "[None for _ in m.tqdm(range(3), desc='Converting and de-quantizing GGUF tensors...')]")
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # the quiet switches inherited from a parent that ran quiet: an explicit --verbose still shows the bars
    inherited = {**os.environ, **QUIET_ENV}
    loud = subprocess.run([sys.executable, "-c", code, "-v"], capture_output=True, text=True, timeout=120, env=inherited)
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
    assert "de-quantizing" not in quiet.stderr and "\r" not in quiet.stderr, quiet.stderr
    assert "de-quantizing" in loud.stderr


def test_commands_without_verbose_are_quiet_too(tmp_path):
    """Prevents init-config, a command with no --verbose flag, printing torchao's import-time lines:
    every command starts quiet (the app's callback), not only those that take --verbose."""
    target = make_target(tmp_path / "target")
    r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "init-config", "--out", str(tmp_path / "d.json"),
                        "--target", str(target), "--num-layers", "1", "--block-size", "4", "--num-target-features", "1"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "src"})
    assert r.returncode == 0, r.stdout + r.stderr
    for noise in BARS + TORCHAO_NOISE:
        assert noise not in r.stderr and noise not in r.stdout, (noise, r.stderr)
