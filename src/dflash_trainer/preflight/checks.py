"""Checks of a command's arguments that need no torch, no transformers and no model.

`cli/` runs them before its heavy imports (torch alone takes ~3 s to import here; a model load
10-30 s), so a bad flag, path or setting is answered in about a second. The loaders repeat the
checks that matter, for callers that skip the CLI. Every error is a ValueError or
FileNotFoundError naming the field and the fix, as the loaders' own. One function per command
(`check_train_config`, `check_prepare`, `check_init_config`, `check_export`, `check_regenerate`;
eval's is `evaluation.settings.check_eval_settings`); what each path must be is in
preflight/paths.py.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from dflash_trainer.config.schema import TrainConfig, field_default
from dflash_trainer.config.sections import DrafterSection, check_flex_tiles
from dflash_trainer.preflight.paths import (check_chat_file, check_drafter, check_drafter_config_file, check_new_folder,
                                            check_prepared, check_run_out, check_target)
from dflash_trainer.files.writable import check_new_file

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


def check_train_config(cfg: TrainConfig) -> None:
    """What a training run can check before torch: the device, what every path the config names
    is (preflight/paths.py), a drafter config file's shape (the drafter section's rules; the
    section itself checked the shape the run derives), the resume folder and the τ prompts."""
    check_device(cfg.runtime.device)
    check_target(cfg.target.path)
    check_chat_file(cfg.data.chats)
    check_prepared(cfg.data.prepared)
    if cfg.drafter.init_from is not None:
        check_drafter(cfg.drafter.init_from, "--init-from")
    check_drafter_config_file(cfg.drafter.drafter_config)
    if cfg.drafter.drafter_config:
        check_drafter_config_shape(cfg)
    if cfg.drafter.init_from and cfg.drafter.drafter_config:
        raise ValueError(f"init_from={cfg.drafter.init_from} and drafter_config={cfg.drafter.drafter_config} are both set; the "
                         "drafter config comes from the init_from folder, drop drafter_config")
    check_file("chat_template", cfg.data.chat_template)
    check_run_out(cfg.out)
    if cfg.runtime.resume not in ("auto", "never") and not Path(cfg.runtime.resume).is_dir():
        raise ValueError(f"resume={cfg.runtime.resume}: no such folder; give a run directory holding checkpoint-* folders")
    if cfg.tau.tau_every:
        check_tau_dataset(cfg.tau.tau_dataset)
    check_fp8_available(cfg.experimental.fp8)


def check_fp8_available(setting: str) -> None:
    """Raise ValueError for fp8 on a machine where CUDA is ruled out or without torchao (the GPU's
    compute capability is checked with torch when the run starts: training.fp8.check_fp8)."""
    if setting == "off":
        return
    from dflash_trainer.drafter.fp8 import torchao_installed, torchao_missing_message

    if cuda_ruled_out():
        raise ValueError(f"fp8={setting} needs a CUDA GPU of compute capability 8.9 or newer (FP8 matmuls) and none "
                         "is visible here: set fp8=off")
    if not torchao_installed():
        raise ValueError(torchao_missing_message(setting))


def check_tau_dataset(name: str) -> None:
    """Raise ValueError unless `tau_dataset` names an eval suite or an existing chat file."""
    from dflash_trainer.data.suites import SUITES

    if name not in SUITES and not Path(name).is_file():
        raise ValueError(f"tau_dataset={name!r}: not a file; use one of {', '.join(SUITES)} or a JSON/JSONL chat file "
                         "(or tau_every=null to measure no τ)")
    if name not in SUITES:
        check_chat_file(name, "tau_dataset")


def check_prepare(out: str, data: str | None, target: str | None, chat_template: str | None) -> None:
    """`prepare`'s paths: OUT new, empty or an earlier prepared folder (written over), the chat
    file, the target (its tokenizer is used) and the template file."""
    check_new_folder(out, "--out", reuse="prepared")
    check_chat_file(data)
    check_target(target)
    check_file("--chat-template", chat_template)


def check_init_config(out: str, target: str | None, chat_template: str | None, *, num_layers: int,
                      block_size: int, layer_types: str, sliding_window: int | None,
                      target_layer_ids: list[int] | None = None,
                      num_target_features: int = field_default("drafter.num_target_features"),
                      mask_token_id: int | None = None) -> tuple[DrafterSection, list[str]]:
    """`init-config`'s flags and paths (the tokenizer and config load after): the drafter's shape
    as the config's drafter section with its rules (`drafter.shape.shape_from_flags`), OUT a
    writable file path, the target and the template file. Returns (section, notes). Raises
    ValueError / FileNotFoundError naming the flag."""
    from dflash_trainer.drafter.shape import shape_from_flags

    shape = shape_from_flags(num_layers=num_layers, block_size=block_size, layer_types=layer_types,
                             sliding_window=sliding_window, target_layer_ids=target_layer_ids,
                             num_target_features=num_target_features, mask_token_id=mask_token_id)
    check_new_file(out, "--out")
    check_target(target)
    check_file("--chat-template", chat_template)
    return shape


def check_drafter_config_shape(cfg: TrainConfig) -> None:
    """The shape rules of the config's drafter section (and, on device=cuda, the flex tiles) on a
    `drafter_config` file's shape: B divides 128, one layer type per layer, a window when a layer
    slides, ascending target layers. Raises ValueError naming the file and the field; an unreadable
    file is left to the loader (check_drafter_config_file checks what it is)."""
    import json

    try:
        body = json.loads(Path(cfg.drafter.drafter_config).read_text())  # type: ignore[arg-type]
        values = dict(num_layers=body["num_hidden_layers"], block_size=body["block_size"],
                      layer_types=",".join(body.get("layer_types") or ["full"] * body["num_hidden_layers"]),
                      sliding_window=body.get("sliding_window"), target_layer_ids=body.get("target_layer_ids"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    try:
        DrafterSection(**values)
        if cfg.runtime.device == "cuda":
            check_flex_tiles(cfg.loss.num_anchors, int(values["block_size"]))
    except ValueError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(e, "errors") else str(e)
        raise ValueError(f"drafter_config={cfg.drafter.drafter_config}: {msg}; regenerate it with init-config") from None


def check_export(source: str, fmt: str, dtype: str, out: str, target: str | None, read_target: bool) -> None:
    """`export`'s flags and paths: format and dtype names, OUT a new folder, SOURCE a drafter folder
    of any kind and, when its tokenizer is read, the target."""
    from dflash_trainer.interop.formats import check_dtype, check_format

    check_format(fmt)
    check_dtype(dtype)
    check_new_folder(out, "--out")
    check_drafter(source, "SOURCE")
    if target is not None and read_target:
        check_target(target)


def check_regenerate(data: str | None, out: str, target: str | None, chat_template: str | None, device: str) -> None:
    """`regenerate`'s paths and device: the chat file (None with --spec: built after), OUT a writable
    file path, the template file, the target."""
    check_chat_file(data)
    check_new_file(out, "--out")
    check_file("--chat-template", chat_template)
    check_device(device)
    check_target(target)
