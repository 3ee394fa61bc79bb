"""A dense copy of a GGUF target, so that only its first load pays for dequantization.

transformers dequantizes a GGUF file at every `from_pretrained(…, gguf_file=…)` (numpy, one thread):
about a minute for Gemma 3 270M or Qwen2.5-Coder-0.5B on a CPU core, 15 s for SmolLM2-135M, and again
for its tokenizer (19 s for Gemma's 262,144 entries). A run loads its target several times (train,
each eval, a drafter and its control), so `load_target` keeps what the first load produced, the
model's weights in the loaded dtype and the tokenizer, as an HF folder (`save_pretrained`:
config.json, safetensors, tokenizer files) and later loads read that folder instead: the same tensors
bit for bit (the dequantized values cast to the dtype, as the GGUF load casts them), the same
tokenizer (tests/unit/test_gguf_cache.py).

Where: `$DFLASH_GGUF_CACHE` (default `~/.cache/dflash_trainer/gguf-dense`; `off` = never read or
write a copy), one folder per (GGUF file name, size, sha256 of its first and last MiB: the header,
the start of the metadata and the last tensors; dtype, transformers and gguf versions): a changed
file or library makes a new folder rather than reusing a stale one, while the same file installed
again (a fresh virtual environment, a new modification time) finds its copy. What the caller adds after loading (a packaged target's chat
template, its stop ids) is not part of the copy. A folder is written under a temporary name and
renamed when complete (the marker `dflash_gguf_source.json` is its last file), so concurrent loads
(a run's evals start together) never read a partial copy; a load that finds another process writing
the same copy (`_writer_alive`) does not write a second one. A copy that cannot be written (disk
full, read-only home, any error of the writers) is skipped with a warning, its temporary folder
removed, and the load goes on from the GGUF; a copy that cannot be read is a warning too, and the
load reads the GGUF (load.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch import nn

MARKER = "dflash_gguf_source.json"
ENV = "DFLASH_GGUF_CACHE"
WRITER_STALE_S = 1800  # a temporary folder older than this is a dead writer's, not a live one's
HEAD_BYTES = 1 << 20  # hashed into the key, from each end: the GGUF header and metadata, the last tensors


def cache_root() -> Path | None:
    """The folder holding the dense copies, or None when `$DFLASH_GGUF_CACHE` is `off`."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() == "off":
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "dflash_trainer" / "gguf-dense"


def _versions() -> str:
    out = []
    for pkg in ("transformers", "gguf"):
        try:
            out.append(f"{pkg}{version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg}-none")
    return "-".join(out)


def _key(gguf: Path) -> str:
    """The file's identity, reading 2 MiB of it: name, size, sha256 (16 hex digits) of its first and
    last MiB, library versions. Not the modification time: every install of the same wheel has
    another, and each would write its own copy."""
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        digest.update(f.read(HEAD_BYTES))
        f.seek(max(size - HEAD_BYTES, 0))
        digest.update(f.read(HEAD_BYTES))
    return f"{gguf.stem}-{size}-{digest.hexdigest()[:16]}-{_versions()}"


def dense_copy(gguf: Path, dtype: torch.dtype | None = None) -> Path | None:
    """The complete dense copy of `gguf` in `dtype` (None: in any dtype; the tokenizer is the same in
    all), or None when there is none or copies are off."""
    root = cache_root()
    if root is None or not root.is_dir():
        return None
    stem = _key(gguf)
    names = [f"{stem}-{str(dtype).removeprefix('torch.')}"] if dtype is not None else \
        sorted(p.name for p in root.glob(f"{stem}-*") if not p.name.count(".tmp-"))
    for name in names:
        if (root / name / MARKER).is_file():
            return root / name
    return None


def _writer_alive(tmp: Path) -> bool:
    """Whether the temporary folder `tmp` (named …tmp-PID) belongs to a writer still at work: recent
    (younger than WRITER_STALE_S) and its pid alive on this host. A writer killed by a signal (a time
    guard's SIGTERM runs no `finally`) leaves a folder that is neither."""
    try:
        if time.time() - tmp.stat().st_mtime >= WRITER_STALE_S:
            return False
        pid = int(tmp.name.rsplit("-", 1)[1])
    except (OSError, ValueError):  # gone (renamed, removed) or not our name pattern
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:  # the process exists (another user's)
        return True
    except OSError:  # no such process
        return False
    return True


def store_dense_copy(gguf: Path, model: nn.Module, tokenizer: Any, dtype: torch.dtype) -> Path | None:
    """Write `model` (dequantized from `gguf`, in `dtype`, quantizer dropped) and `tokenizer` (as
    loaded from the GGUF, before the caller adds anything) as a dense copy; returns its folder, or
    None when copies are off, another process is writing the same copy, or the write failed (a
    warning says why; the caller goes on with the loaded model). Temporary folders of dead writers
    are removed."""
    root = cache_root()
    if root is None:
        return None
    tmp = None
    try:
        key = _key(gguf)
        final = root / f"{key}-{str(dtype).removeprefix('torch.')}"
        for other in root.glob(f"{final.name}.tmp-*") if root.is_dir() else []:
            if _writer_alive(other):
                return None  # a live writer's copy: one is enough
            shutil.rmtree(other, ignore_errors=True)
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "dtype": str(dtype), "key": key}) + "\n")
        try:
            tmp.rename(final)
        except OSError:  # another load finished first: its copy is the same
            pass
        return final if (final / MARKER).is_file() else None
    except Exception as e:  # noqa: BLE001 - any failure of the writers (safetensors, tokenizers, the disk) is not the load's
        warnings.warn(f"{gguf.name}: could not keep a dense copy under {root} ({type(e).__name__}: {e}); every load "
                      f"dequantizes the GGUF again (set {ENV}=DIR for another folder, or {ENV}=off)", stacklevel=2)
        return None
    finally:  # also on KeyboardInterrupt; a process killed by a signal leaves it to the next writer (_writer_alive)
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
