"""Provenance of a run: argv, git SHA, package versions, devices, time."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def _git_sha() -> str | None:
    try:
        root = Path(__file__).resolve().parents[3]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict[str, Any]:
    """A JSON-serializable record of how and where this process runs."""
    versions = {}
    for pkg in ("dflash-trainer", "torch", "transformers", "datasets", "safetensors", "pydantic", "gguf", "torchao"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "argv": [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else [],  # the script by name, not its install path
        "git_sha": _git_sha(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "cuda_devices": devices,
        "cpu_threads": torch.get_num_threads(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
