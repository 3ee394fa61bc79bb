"""Checkpoints: drafter weights + config, written atomically, and the state that resumes a run.

Layout of a checkpoint folder:
  config.json          the DrafterConfig plus `dflash` metadata (mask token reason, chat template,
                       thinking flag, target name, step)
  model.safetensors    trainable drafter weights only (`layers.*`, `fc`, `hidden_norm`, `norm`);
                       the embedding and LM head are the target's and are never saved
  training_state.pt    only in training checkpoints (`OUT/checkpoint-{step}`, `checkpoint-final`):
    progress           step (optimizer steps; the data position and the anchors follow from it:
                       rows of batch step // anchor_draws_per_row by (seed, epoch), anchors by
                       (seed, epoch, row, draw)), with epoch, batch_in_epoch and draw written out
                       for reading, target tokens seen, skipped (non-finite) steps, logged losses
    optimizer, scheduler  state dicts
    metrics            the on-device metric sums since the last log (so logs continue exactly)
    config             the resolved TrainConfig (a resume with another config is refused)
    layout             "colocated" | "pipeline" (+ num_drafters for the pipeline)

A folder is written under a temporary name, every file fsync'ed, then renamed into place, so a
half-written checkpoint is never picked up; folders whose name starts with "." are temporary. The
last `keep_last` step checkpoints are kept; `checkpoint-final` is never deleted.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_trainer.config.schema import check_saved_format, flat_config, portable_saved, resolved_paths
from dflash_trainer.interop.formats import CONFIG_FILE, TRAINING_STATE_FILE, WEIGHTS_FILE, is_checkpoint
from dflash_trainer.telemetry.provenance import provenance

# ----------------------------------------------------------------------------------------------
# Resuming a run

_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")

# Config settings (`section.field`) that may differ between a run and its resume (they do not change the math).
RESUME_MUTABLE = frozenset({
    "out", "optim.max_steps", "runtime.log_every", "runtime.save_every", "runtime.keep_last", "runtime.resume",
    "runtime.device", "runtime.threads", "runtime.compile", "experimental.loss_impl", "target.target_attention", "target.target_compile",
    "target.overlap_target", "target.feature_cache_gib", "data.chats", "data.prepared",
    "layout.queue_depth", "layout.comm_timeout_s", "layout.dry_run",
    "data.validation_max_rows", "data.validation_max_seconds",  # how much validation, after training
    # measured τ reads the weights between steps and changes none (training/tau_probe.py)
    "tau.tau_every", "tau.tau_prompts", "tau.tau_max_new_tokens", "tau.tau_dataset",
    # a profiled window times steps and changes none (training/run_profile.py)
    "experimental.profile_at_step", "experimental.profile_steps",
    # which devices run the ranks does not change the math; the layout and the
    # number of drafters are checked on resume (check_resumable)
    "layout.target_gpus", "layout.drafter_gpus", "layout.target_procs", "layout.drafter_procs",
    "layout.gpus", "layout.procs", "experimental.split_ddp_efficiency", "experimental.split_probe_s"})


@dataclass
class Progress:
    """Where the run stands; saved in and restored from `training_state.pt`."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    draw: int = 0  # anchor draws already trained on batch `batch_in_epoch` (anchor_draws_per_row > 1)
    tokens: int = 0  # context tokens the target processed (once per batch, however many draws)
    skipped_steps: int = 0
    losses: list[float] = field(default_factory=list)
    # seconds up to this checkpoint over every segment of the run (a resume adds its own): process wall
    # time, and the training loop's alone (what tok/s divides by)
    wall_seconds: float = 0.0
    train_seconds: float = 0.0


def training_state(layout: dict[str, Any], prog: Progress, opt: torch.optim.Optimizer, sched: Any, metric_sums: torch.Tensor,
                   config: dict[str, Any]) -> dict[str, Any]:
    """The `training_state.pt` body of a resumable checkpoint (module docstring). layout: {"layout":
    "colocated"} or {"layout": "pipeline", "num_drafters": M}; metric_sums: MetricAccumulator.state()."""
    return {**layout, "progress": asdict(prog), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "metrics": metric_sums, "config": config, "provenance": provenance()}


def restore_training(state: dict[str, Any], weights: dict[str, torch.Tensor], drafter: Any, opt: torch.optim.Optimizer,
                     sched: Any, acc: Any) -> Progress:
    """Load a resumable checkpoint (`load_step_checkpoint` output) into the drafter, optimizer,
    scheduler and metric accumulator; returns where the run stands."""
    drafter.load_trainable_state_dict(weights)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    acc.load_state(state["metrics"])
    return Progress(**state["progress"])


def step_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every resumable checkpoint (`is_checkpoint(resumable=True)`) named
    checkpoint-{step} or checkpoint-final in `out`, newest first. Reads only config.json."""
    found = []
    for p in Path(out).glob("checkpoint-*"):
        m = _STEP_DIR.match(p.name)
        if is_checkpoint(p, resumable=True):
            if m:
                found.append((int(m.group(1)), p))
            elif p.name == "checkpoint-final":
                found.append((-1, p))  # ordered by its saved step below
    out_list = []
    for step, p in found:
        if step < 0:
            try:  # the step recorded in the checkpoint's metadata (cheap: no tensor load)
                step = int(json.loads((p / CONFIG_FILE).read_text())["dflash"]["step"])
            except (OSError, ValueError, KeyError, TypeError):  # unreadable: the caller's fallback handles it
                step = 0
        out_list.append((step, p))
    return sorted(out_list, key=lambda t: (t[0], t[1].name == "checkpoint-final"), reverse=True)


def load_latest(out: Path, log: Callable[[str], None], load: Callable[[Path], Any] | None = None) -> Any:
    """Newest readable training checkpoint in `out`: (folder, training_state, drafter weights), or
    what `load` (default `load_step_checkpoint`; `peek_step_checkpoint`) returns for its folder.

    A checkpoint that fails to load (truncated file, bad safetensors) is reported through `log`
    and the next older one is tried. Returns None when there is none.
    """
    load = load or load_step_checkpoint
    for _, folder in step_checkpoints(out):
        try:
            return load(folder)
        except Exception as e:  # noqa: BLE001 - any corruption means: fall back
            log(f"checkpoint {folder} is unreadable ({type(e).__name__}: {str(e)[:120]}); falling back to the previous one")
    return None


def load_step_checkpoint(folder: Path) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """(folder, training_state, drafter weights) of one checkpoint folder; raises on unreadable files."""
    state = torch.load(folder / TRAINING_STATE_FILE, map_location="cpu", weights_only=False)
    return folder, state, load_file(str(folder / WEIGHTS_FILE))


def peek_step_checkpoint(folder: Path) -> tuple[Path, dict[str, Any]]:
    """(folder, training_state) of one checkpoint folder without reading its tensors: the state's
    tensors are memory-mapped, not read, and of the weights only the header is read (a truncated
    file fails both, as it fails `load_step_checkpoint`). For checking a resume (`check_resumable`)
    before the run writes anything; raises on unreadable files."""
    state = torch.load(folder / TRAINING_STATE_FILE, map_location="cpu", weights_only=False, mmap=True)
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        f.keys()
    return folder, state


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], folder: Path) -> None:
    """Raise ValueError naming the settings (`section.field`) when the checkpoint in `folder` was
    written with a different config. `saved`: the checkpoint's saved config (format_version 2);
    `current`: this run's `TrainConfig.model_dump()` (or saved_config). A saved config in another
    layout (the flat one of earlier releases) raises ValueError naming the folder and the fix
    (`check_saved_format`).

    Settings only one side knows (a newer or older version of the tool) are not compared: a new
    field's default keeps the old behaviour. Paths are compared as `saved_config` writes them
    (`portable_saved` on both sides): a checkpoint of older code, its paths as given, still resumes.
    """
    check_saved_format(saved, folder)
    saved, current = flat_config(portable_saved(saved)), flat_config(portable_saved(current))
    run = Path(folder).parent  # the run folder the paths are relative to; one path spelled two ways is one path
    real_saved, real_current = resolved_paths(saved, run), resolved_paths(current, run)
    diff = sorted(k for k in set(saved) & set(current)
                  if k not in RESUME_MUTABLE and real_saved[k] != real_current[k])
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in diff[:6])
        raise ValueError(f"checkpoint {folder} was written with a different config ({detail}); "
                         "resume with the same settings or start a new --out")


def check_resumable(state: dict[str, Any], current: dict[str, Any], folder: Path, layout: str,
                    num_drafters: int | None = None) -> None:
    """Raise ValueError unless the training state `state` can continue this run exactly: the same
    config (`check_resume_config`), the same layout ("colocated" | "pipeline"; checkpoints without
    the marker are co-located ones) and, for the pipeline, the same number of drafter ranks. Fresh
    runs of every layout train alike (tests/distributed/test_pipeline_equivalence.py); continuing a
    checkpoint in another layout is not tested, so it is refused."""
    check_resume_config(state["config"], current, folder)
    saved_layout = state.get("layout", "colocated")
    if saved_layout != layout:
        how = ("without a process layout" if saved_layout == "colocated" else
               "with the same --target-gpus/--drafter-gpus (or --target-procs/--drafter-procs)")
        raise ValueError(f"checkpoint {folder} was written by the {saved_layout.replace('colocated', 'co-located')} "
                         f"run: resume it {how}, or start a new --out")
    if num_drafters is not None and state.get("num_drafters") != num_drafters:
        raise ValueError(f"checkpoint {folder} was trained with {state.get('num_drafters')} drafter ranks, this run "
                         f"has {num_drafters}: the micro-batches (and the anchors they seed) would differ; resume with "
                         "the same number of drafter GPUs/processes (the target ranks may change)")


def prune(out: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints (never checkpoint-final)."""
    steps = sorted((int(m.group(1)), p) for p in Path(out).glob("checkpoint-*") if (m := _STEP_DIR.match(p.name)))
    for _, p in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


