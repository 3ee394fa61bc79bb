"""Provenance of a run: argv, git SHA (and whether tracked files differ from it), package versions,
devices, time."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def _git(*args: str) -> str | None:
    """stdout of `git -C <the package's checkout> args` (stripped), None without git, a checkout or an answer."""
    try:
        root = Path(__file__).resolve().parents[3]
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_sha() -> str | None:
    return _git("rev-parse", "HEAD") or None


def _git_dirty() -> bool | None:
    """True when tracked files differ from HEAD (the SHA alone then does not name the code that ran)."""
    status = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")  # no index.lock
    return None if status is None else bool(status)


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
        "git_dirty": _git_dirty(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "cuda_devices": devices,
        "cpu_threads": torch.get_num_threads(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
