"""`dflash-train default-run` (registered in dflash_trainer/cli/main.py; what `make train` runs): the real job
where torch sees a CUDA GPU, the recipe for the embedded SmolLM2 (`recipe --out OUT`:
measured τ 3.42 MT-Bench on one H100 in 24.4 min of stages, from scratch); else the CPU smoke run (`train --out OUT --config configs/smoke-cpu.yaml`,
3–9 min on 2 cores, not a useful drafter). It says which and why, then replaces itself with that command."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_trainer.cli.common import console
from dflash_trainer.cli.common import fail as _fail

SMOKE_CONFIG = "configs/smoke-cpu.yaml"


@dataclass(frozen=True)
class DefaultRun:
    """The chosen job: `argv` (the `dflash-train` arguments), `kind` ("recipe" or "smoke") and `why` (the
    lines printed before it starts)."""

    argv: list[str]
    kind: str
    why: str


def choose_default_run(out: str, gpu: Optional[str], smoke_config: str = SMOKE_CONFIG) -> DefaultRun:
    """The job for a machine whose first CUDA GPU is named `gpu` (None: torch sees no CUDA GPU)."""
    smoke = ["train", "--out", out, "--config", smoke_config]
    recipe = ["recipe", "--out", out]
    if gpu is not None:
        return DefaultRun(recipe, "recipe", (
            f"CUDA GPU found ({gpu}): running the recipe for the embedded SmolLM2, `dflash-train {shlex.join(recipe)}` "
            f"(mixture → regenerate → prepare → train → eval → export → report, sized to this card; measured τ 3.42 "
            f"MT-Bench on one H100 in 24.4 min of stages, from scratch; add `--plan` to see this card's plan).\n"
            f"The short smoke run instead: `dflash-train {shlex.join(smoke)}`."))
    return DefaultRun(smoke, "smoke", (
        f"No CUDA GPU visible to torch: running the CPU smoke run, `dflash-train {shlex.join(smoke)}` (3–9 min on "
        f"2 cores). It checks the pipeline end to end; its drafter (τ ≈ 1.1) is NOT a useful drafter.\n"
        f"The real job is `dflash-train {shlex.join(recipe)}` on a GPU host (a CUDA torch: `make train TORCH=torch`): "
        f"measured τ 3.42 MT-Bench on one H100 in 24.4 min of stages, from scratch."))


def _visible_gpu() -> Optional[str]:
    """The name of CUDA device 0, None when torch sees no CUDA GPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def default_run_cmd(
    out: Annotated[str, typer.Option(help="Run folder of the chosen job.")] = "runs/default",
    smoke_config: Annotated[str, typer.Option(help="The CPU smoke run's config (relative to the working directory).")] = SMOKE_CONFIG,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the choice and the command; run nothing.")] = False,
) -> None:
    """The default job (`make train`): the SmolLM2 recipe on a GPU host, else the CPU smoke run; prints which and why."""
    run = choose_default_run(out, _visible_gpu(), smoke_config)
    console.print(f"[default-run] {run.why}", highlight=False, markup=False)
    if run.kind == "smoke" and not Path(smoke_config).is_file():
        _fail(f"--smoke-config {smoke_config}: file not found; run from the repository root (where `make train` "
              f"runs) or pass --smoke-config PATH")
        return
    if dry_run:
        console.print(f"dflash-train {shlex.join(run.argv)}", highlight=False, markup=False)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # the chosen command replaces this process: its output, signals (Ctrl-C, SIGTERM) and exit status are its own
    os.execv(sys.executable, [sys.executable, "-m", "dflash_trainer.cli.main", *run.argv])
