"""A CLI that answers at once: bad flags, paths and settings are refused before torch is imported
or a model loads (one line on stderr, exit 2; tests/integration/test_preflight_paths.py proves no
heavy import or step comes first, without timing anything), `--help` shows the defaults, and
training that writes to a pipe shows periodic progress lines instead of a bar drawn only at the end."""

import os
import subprocess
import sys

import pytest

from dflash_trainer.preflight.checks import cuda_ruled_out
from tests.integration.tiny_run import make_prepared, make_target, train_cmd

CLI = [sys.executable, "-m", "dflash_trainer.cli.main"]
no_cuda = pytest.mark.skipif(not cuda_ruled_out(), reason="needs a machine where CUDA is ruled out")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("clifast")
    return d, make_target(d / "target"), make_prepared(d / "prepared")


CASES = {
    "export --format nosuch": (["export", "{d}/nowhere", "--format", "nosuch", "--out", "{d}/exp"],
                               ["--format 'nosuch': use one of zlab, speculators"]),
    "train --target missing": (["train", "--out", "{d}/r", "--target", "/nonexistent"],
                               ["--target /nonexistent: path not found", "HF model folder"]),
    "train --data missing": (["train", "--out", "{d}/r", "--target", "{target}", "--data", "{d}/missing.jsonl"],
                             ["--data", "missing.jsonl: file not found"]),
    "train --set typo": (["train", "--out", "{d}/r", "--target", "{target}", "--set", "seqlen=256"],
                         ["'seqlen' is not a config field", "did you mean data.seq_len"]),
    "eval --drafter missing": (["eval", "--drafter", "/nonexistent", "--target", "{target}"],
                               ["--drafter /nonexistent: not found"]),
    "eval --batch-sizes bad": (["eval", "--drafter", "{d}", "--target", "{target}", "--batch-sizes", "1,0"],
                               ["--batch-sizes '1,0': every batch size must be >= 1"]),
    "eval --dtype bad": (["eval", "--drafter", "{d}", "--target", "{target}", "--dtype", "fp16"],
                         ["--dtype 'fp16': pass one of auto, float32, bfloat16"]),
    "regenerate --data missing": (["regenerate", "--data", "{d}/missing.jsonl", "--out", "{d}/regen.jsonl",
                                   "--target", "{target}"], ["--data", "missing.jsonl: file not found"]),
    "train --device cuda": (["train", "--out", "{d}/r", "--target", "{target}", "--device", "cuda"],
                            ["device=cuda but no CUDA device is visible; use --device cpu"]),
    "eval --device cuda": (["eval", "--drafter", "{d}", "--target", "{target}", "--device", "cuda"],
                           ["device=cuda but no CUDA device is visible"]),
    "train --gpus with --target-gpus": (["train", "--out", "{d}/r", "--target", "{target}", "--gpus", "0-7",
                                         "--target-gpus", "0-4", "--drafter-gpus", "5-7"],
                                        ["--gpus measures and chooses the split, --target-gpus/--drafter-gpus give "
                                         "one", "drop --gpus to keep your split"]),
    "train --procs with --drafter-procs": (["train", "--out", "{d}/r", "--procs", "3", "--drafter-procs", "1",
                                            "--dry-run"], ["--procs", "--drafter-procs give one"]),
    "train --gpus and --procs": (["train", "--out", "{d}/r", "--gpus", "0-1", "--procs", "2"],
                                 ["--gpus (GPU processes) and --procs (CPU processes) exclude each other"]),
    "train --gpus one GPU": (["train", "--out", "{d}/r", "--target", "{target}", "--gpus", "0"],
                             ["--gpus 0: an automatic split needs at least 2 GPUs", "drop --gpus"]),
    "train --procs 1": (["train", "--out", "{d}/r", "--target", "{target}", "--procs", "1", "--dry-run"],
                        ["--procs 1: an automatic split needs at least 2 processes"]),
    "train --gpus bad list": (["train", "--out", "{d}/r", "--gpus", "3-1"], ["--gpus '3-1': expected GPU indices"]),
    "train --gpus without cuda": (["train", "--out", "{d}/r", "--target", "{target}", "--gpus", "0-1"],
                                  ["--gpus needs CUDA GPUs but none is visible; use --procs N"]),
    "train --procs bad efficiency": (["train", "--out", "{d}/r", "--procs", "2", "--set", "split_ddp_efficiency=1.5"],
                                     ["split_ddp_efficiency"]),
}


@pytest.mark.parametrize("case", [pytest.param(k, marks=no_cuda if "cuda" in k else ()) for k in CASES])
def test_bad_input_is_refused_at_once_on_stderr(tiny, case):
    """Prevents a bad flag being answered only after the model loads (12-30 s before), and errors on
    stdout, where they mix with results that scripts parse."""
    d, target, _ = tiny
    args, needles = CASES[case]
    r = subprocess.run(CLI + [a.format(d=d, target=target) for a in args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    assert err.startswith("error:") and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert "error" not in r.stdout, r.stdout
    assert not (d / "r").exists()  # refused before the run directory is made


def test_help_shows_defaults():
    """Prevents `train --help` hiding the values a run uses (its flags default to None = the config's)."""
    r = subprocess.run(CLI + ["train", "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    text = " ".join(r.stdout.split())
    assert r.returncode == 0
    for shown in ("[default: (runs/default)]", "unset: optim.epochs passes", "[default: (auto)]", "[default: (10)]"):
        assert shown in text, (shown, text)


def test_piped_training_prints_progress_lines(tiny, tmp_path):
    """Prevents a run under `| tee` or a scheduler showing nothing until the end: without a terminal,
    each metric log is one plain line with step, loss, τ, tok/s and ETA, written as it happens."""
    d, target, prepared = tiny
    cmd = train_cmd(tmp_path / "run", target, prepared, "--max-steps", "4", "--log-every", "2",
                    "--set", "save_every=null", "--set", "validation_fraction=0")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    for line in proc.stdout:  # read while it runs: the lines must not wait in a buffer until exit
        if line.startswith("train step"):
            first = line
            break
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, rest + err
    assert first is not None, rest + err
    lines = [first] + [ln for ln in rest.splitlines() if ln.startswith("train step")]
    assert [ln.split()[2] for ln in lines] == ["2/4", "4/4"], lines
    for ln in lines:
        for part in ("loss ", "τ≈", "tok/s", "elapsed", "ETA"):
            assert part in ln, (part, ln)
    assert "━" not in rest  # no rich bar in the piped output


def test_piped_validation_prints_progress_and_row_counts(tiny, tmp_path):
    """Prevents a silent, unbounded validation at the end of a run (minutes on a CPU, even after a
    3-step smoke test): piped output shows one progress line per validated row here, and a budget
    that cuts validation short is said on the console, in the summary and in summary.json."""
    import json

    d, target, _ = tiny
    prepared = make_prepared(tmp_path / "prepared", rows=4, validation_rows=5)
    out = tmp_path / "run"
    cmd = train_cmd(out, target, prepared, "--max-steps", "2", "--set", "save_every=null",
                    "--set", "validation_max_rows=3")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("validate row")]
    assert [ln.split()[2] for ln in lines] == ["1/3", "2/3", "3/3"], r.stdout
    assert all("loss " in ln and "ETA" in ln for ln in lines), lines
    text = " ".join(r.stdout.split())
    assert "validation: 3 of 5 rows (validation_max_rows reached)" in text, text
    assert "on 3 of 5 rows (validation_max_rows reached)" in text, text  # the printed summary
    v = json.loads((out / "summary.json").read_text())["validation"]
    assert (v["rows_validated"], v["rows_total"], v["cut_by"]) == (3, 5, "validation_max_rows")
    assert v["loss"] is not None and f"validation loss {v['loss']:.3f}" in text


def test_bad_data_is_refused_before_the_model_loads(tiny, tmp_path):
    """Prevents waiting minutes for a large target to load only to learn that no conversation is
    usable: the co-located run prepares (and checks) the data with the tokenizer alone first. The
    target folder here has its tokenizer but no weights, so reaching the model load would fail with
    another error."""
    import shutil

    _, target, _ = tiny
    no_weights = tmp_path / "target-no-weights"
    shutil.copytree(target, no_weights, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"from": "gpt", "value": "an answer to nothing"}]}\n{"messages": "oops"}\n')
    r = subprocess.run(CLI + ["train", "--out", str(tmp_path / "run"), "--target", str(no_weights), "--data", str(bad),
                              "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no usable conversation" in r.stderr and "no_user_turn" in r.stderr, r.stderr
    assert "safetensors" not in r.stderr and "Error no file named" not in r.stderr
    assert not (tmp_path / "run").exists()  # the refused start leaves no run folder (pipeline/failed_start.py)
