"""`dflash-train default-run` (`make train`): the recipe where torch sees a CUDA GPU, the CPU smoke run
elsewhere, each said before it starts. CUDA's presence is monkeypatched; nothing is trained here."""

import os
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dflash_trainer.cli.default_run import choose_default_run
from dflash_trainer.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def test_choice_per_machine():
    """Prevents a GPU host training the 5-minute smoke drafter, or a CPU running the GPU recipe."""
    gpu = choose_default_run("runs/default", "NVIDIA H200")
    assert (gpu.kind, gpu.argv) == ("recipe", ["recipe", "--out", "runs/default"])
    assert "CUDA GPU found (NVIDIA H200)" in gpu.why and "`dflash-train recipe --out runs/default`" in gpu.why
    cpu = choose_default_run("runs/b", None)
    assert (cpu.kind, cpu.argv) == ("smoke", ["train", "--out", "runs/b", "--config", "configs/smoke-cpu.yaml"])
    assert "CPU smoke run" in cpu.why and "NOT a useful drafter" in cpu.why
    assert "The real job is `dflash-train recipe --out runs/b` on a GPU host" in cpu.why


@pytest.mark.parametrize("cuda, expect", [
    (False, ["train", "--out", "OUT", "--config", "configs/smoke-cpu.yaml"]),
    (True, ["recipe", "--out", "OUT"]),
])
def test_command_execs_the_choice(monkeypatch, cuda, expect):
    """Prevents `make train` running something other than what it printed: the process is replaced by
    `python -m dflash_trainer.cli.main` with the chosen arguments (os.execv recorded, not called)."""
    monkeypatch.chdir(ROOT)  # the smoke config's path is relative to the repository root, as in `make train`
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    calls = []
    monkeypatch.setattr(os, "execv", lambda exe, argv: calls.append((exe, argv)))
    result = CliRunner().invoke(app, ["default-run", "--out", "OUT"])
    assert result.exit_code == 0, result.output
    assert calls == [(sys.executable, [sys.executable, "-m", "dflash_trainer.cli.main", *expect])]
    text = " ".join(result.output.split())
    assert ("CUDA GPU found" in text) == cuda and ("CPU smoke run" in text) == (not cuda)


def test_dry_run_and_a_missing_smoke_config(monkeypatch, tmp_path):
    """Prevents a CPU smoke run started outside the repository failing later with a bare missing-file error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "execv", lambda exe, argv: pytest.fail("must not run"))
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["default-run", "--out", "OUT", "--dry-run"])
    assert result.exit_code == 0 and result.output.rstrip().endswith(
        "dflash-train train --out OUT --config configs/smoke-cpu.yaml")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["default-run", "--out", "OUT"])
    assert result.exit_code == 2
    assert "--smoke-config configs/smoke-cpu.yaml: file not found; run from the repository root" in " ".join(
        result.output.split())
