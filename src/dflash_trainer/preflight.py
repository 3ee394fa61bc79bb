"""Checks of a command's arguments that need no torch, no transformers and no model.

`cli.py` runs them before its heavy imports (torch alone takes ~3 s to import here; a model load
10-30 s), so a bad flag, path or setting is answered in about a second. The loaders repeat the
checks that matter, for callers that skip the CLI. Every error is a ValueError or
FileNotFoundError naming the field and the fix, as the loaders' own.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from dflash_trainer.config import TrainConfig
from dflash_trainer.target_model.paths import resolve_target_path

NO_CUDA = "device=cuda but no CUDA device is visible; use --device cpu"


def cuda_ruled_out() -> bool:
    """True when torch cannot see a CUDA device, decided without importing torch: a CPU-only torch
    build (version `+cpu`), macOS, or CUDA_VISIBLE_DEVICES empty or -1. False means
    "maybe": `training.run.resolve_device` asks torch later. (Device nodes are not consulted: a
    GPU machine whose nodes live elsewhere must never be refused.)"""
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return True
    except importlib.metadata.PackageNotFoundError:  # torch without metadata (a source build): maybe
        return False
    if sys.platform == "darwin":
        return True
    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")


def check_device(name: str) -> None:
    """Raise ValueError for device=cuda on a machine where CUDA is ruled out (see cuda_ruled_out)."""
    if name == "cuda" and cuda_ruled_out():
        raise ValueError(NO_CUDA)


def check_file(field: str, path: str | None) -> None:
    """Raise FileNotFoundError when `path` is set and is not a file."""
    if path is not None and not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"{field}={str(path)!r}: file not found")


def check_folder(field: str, path: str | None) -> None:
    """Raise FileNotFoundError when `path` is set and is not a folder."""
    if path is not None and not Path(path).expanduser().is_dir():
        raise FileNotFoundError(f"{field}={str(path)!r}: folder not found")


def check_train_config(cfg: TrainConfig) -> None:
    """What a training run can check before torch: the device, and every path the config names."""
    check_device(cfg.device)
    resolve_target_path(cfg.target)  # also: the embedded package when target is None
    check_file("data", cfg.data)
    check_folder("prepared", cfg.prepared)
    check_file("drafter_config", cfg.drafter_config)
    check_folder("init_from", cfg.init_from)
    check_file("chat_template", cfg.chat_template)
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).is_dir():
        raise ValueError(f"resume={cfg.resume}: no such folder; give a run directory holding checkpoint-* folders")
    if cfg.tau_every:
        check_tau_dataset(cfg.tau_dataset)


def check_tau_dataset(name: str) -> None:
    """Raise ValueError unless `tau_dataset` names an eval suite or an existing chat file."""
    from dflash_trainer.evaluation.suites import SUITES

    if name not in SUITES and not Path(name).is_file():
        raise ValueError(f"tau_dataset={name!r}: not a file; use one of {', '.join(SUITES)} or a JSON/JSONL chat file "
                         "(or tau_every=null to measure no τ)")
