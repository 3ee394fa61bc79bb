"""Export formats and dtypes by name, and the checks of an export's arguments. Torch-free: the CLI
runs them before loading anything; `export.write_export` runs them again."""

from __future__ import annotations

from pathlib import Path

FORMATS = ("zlab", "speculators")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_format(fmt: str) -> None:
    """Raise ValueError unless `fmt` is one of FORMATS."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")


def check_dtype(dtype: str) -> None:
    """Raise ValueError unless `dtype` is keep or one of DTYPE_NAMES."""
    if dtype != "keep" and dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype {dtype!r}: use keep or one of {', '.join(DTYPE_NAMES)}")


def check_new_folder(out: str | Path) -> None:
    """Raise ValueError when `out` exists and is a file or a non-empty folder."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not empty; choose a new folder")


def check_drafter_folder(path: str | Path) -> Path:
    """The config.json of a drafter folder; raises ValueError when there is none."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no config.json; give a drafter folder (checkpoint, zlab or speculators export)")
    return cfg_file
