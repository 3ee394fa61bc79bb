"""A drafter checkpoint folder on disk: written atomically, read back (config, weights, metadata).

Layout (training/checkpoint.py adds training_state.pt, what resumes a run):
  config.json          the DrafterConfig plus `dflash` metadata (mask token reason, chat template,
                       thinking flag, target name, step)
  model.safetensors    trainable drafter weights only (`layers.*`, `fc`, `hidden_norm`, `norm`);
                       the embedding and LM head are the target's and are never saved
  training_state.pt    optional: any picklable state, written with the rest

A folder is written under a temporary name, every file fsync'ed, then renamed into place, so a
half-written checkpoint is never picked up; folders whose name starts with "." are temporary.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.interop.formats import CONFIG_FILE, TRAINING_STATE_FILE, WEIGHTS_FILE, is_checkpoint


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: Path, weights: dict[str, torch.Tensor], config: DrafterConfig,
                    metadata: dict[str, Any], training_state: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint folder atomically at `path` (replacing an existing one).

    weights: name → tensor (copied to CPU, contiguous). Raises OSError naming the path, the space
    needed (tensor bytes of weights and training state) and the space free when the disk is full
    or the folder is unwritable; nothing is written when the free space is known to be too small
    beforehand, and the previous checkpoint at `path` (if any) stays intact in every case.
    """
    path = Path(path)
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    need = _tensor_bytes(cpu) + _tensor_bytes(training_state)
    tmp: Path | None = None
    old: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < need + (1 << 20):
            raise OSError(errno.ENOSPC, f"not enough space: needs about {need / 2**20:.1f} MiB, "
                                        f"{free / 2**20:.1f} MiB free")
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        save_file(cpu, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        body = {**config.model_dump(), "dflash": metadata}
        (tmp / CONFIG_FILE).write_text(json.dumps(body, indent=2) + "\n")
        if training_state is not None:
            torch.save(training_state, tmp / TRAINING_STATE_FILE)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # readable like any model folder (mkdtemp makes private entries)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        _fsync_dir(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not path.exists():
            os.replace(old, path)  # the rename into place failed: put the previous checkpoint back
        raise OSError(e.errno, f"could not write checkpoint {path} (needs about {need / 2**20:.1f} MiB): "
                               f"{e.strerror or e}; the previous checkpoints in {path.parent} are intact") from e
    return path


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside nested dicts / lists / tuples (0 for None)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def load_checkpoint(path: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Read (config, weights, metadata) from a checkpoint folder written by `save_checkpoint`.

    Raises ValueError naming the folder when config.json or model.safetensors is missing.
    """
    path = Path(path)
    if not is_checkpoint(path):
        raise ValueError(f"{path}: not a drafter checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    body = json.loads((path / CONFIG_FILE).read_text())
    meta = body.pop("dflash", {})
    return DrafterConfig(**body), load_file(str(path / WEIGHTS_FILE)), meta
