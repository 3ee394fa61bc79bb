"""Export formats and dtypes by name, the checks of an export's arguments, what a drafter folder
and a checkpoint folder are, and which kind of drafter folder a config.json describes. Torch-free:
the CLI runs them before loading anything; `export.write_export`, `load_drafter` and the
checkpoint readers (`training/checkpoint.py`) run them again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def check_verifier(verifier: str | None) -> None:
    """Raise ValueError for an empty or whitespace-padded `--verifier` (None = derive it)."""
    if verifier is not None and (not verifier.strip() or verifier != verifier.strip()):
        raise ValueError(f"--verifier {verifier!r}: give a hub id such as Qwen/Qwen3-8B or the path where the "
                         "target is served, without surrounding spaces")


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAINING_STATE_FILE = "training_state.pt"


def is_drafter_folder(path: str | Path) -> bool:
    """True when `path` holds a config.json: a drafter folder of some kind (checkpoint, zlab or
    speculators export; `detect_kind` tells which)."""
    return (Path(path) / CONFIG_FILE).is_file()


def is_checkpoint(path: str | Path, *, resumable: bool = False) -> bool:
    """True when `path` is a checkpoint folder of this trainer: config.json and model.safetensors,
    and with `resumable` also training_state.pt (the state that continues a run). Reads nothing."""
    p = Path(path)
    files = (CONFIG_FILE, WEIGHTS_FILE, TRAINING_STATE_FILE) if resumable else (CONFIG_FILE, WEIGHTS_FILE)
    return all((p / f).is_file() for f in files)


def check_drafter_folder(path: str | Path) -> Path:
    """The config.json of a drafter folder; raises ValueError when there is none."""
    cfg_file = Path(path) / CONFIG_FILE
    if not is_drafter_folder(path):
        raise ValueError(f"{path}: no config.json; give a drafter folder (checkpoint, zlab or speculators export)")
    return cfg_file


def detect_kind(body: dict[str, Any]) -> str:
    """'checkpoint' | 'zlab' | 'speculators' for a parsed drafter config.json: speculators by
    `speculators_model_type`; z-lab by `dflash_config` or architectures DFlashDraftModel; a
    dflash-train checkpoint by its `dflash` metadata block and `target_layer_ids`. ValueError if none fits."""
    if "speculators_model_type" in body:
        return "speculators"
    if "dflash_config" in body or "DFlashDraftModel" in (body.get("architectures") or []):
        return "zlab"
    if "dflash" in body and "target_layer_ids" in body:
        return "checkpoint"
    archs = body.get("architectures")
    raise ValueError(f"config.json is neither a dflash-train checkpoint, a z-lab DFlash drafter "
                     f"(architectures DFlashDraftModel) nor a speculators dflash drafter (architectures={archs})")


# The block size a folder's config.json implies when it names none (load_drafter.py reads the same).
ZLAB_DEFAULT_BLOCK_SIZE = 16
SPECULATORS_DEFAULT_BLOCK_SIZE = 8


def declared_block_size(body: dict[str, Any], kind: str) -> int | None:
    """The block size B a drafter folder's config.json (`body`, of `detect_kind` kind) declares: zlab
    `dflash_config.block_size`, else the top level, else ZLAB_DEFAULT_BLOCK_SIZE; speculators the top
    level, else SPECULATORS_DEFAULT_BLOCK_SIZE; a checkpoint the top level (None when absent). Raises
    ValueError / TypeError for a value that is no integer."""
    if kind == "zlab":
        block = (body.get("dflash_config") or {}).get("block_size", body.get("block_size", ZLAB_DEFAULT_BLOCK_SIZE))
    else:
        block = body.get("block_size", SPECULATORS_DEFAULT_BLOCK_SIZE if kind == "speculators" else None)
    return int(block) if block is not None else None


def trained_block_size(path: str | Path | None) -> int | None:
    """The block size B a drafter folder (checkpoint, zlab or speculators export) was trained at, read
    from its config.json as `load_drafter` reads it (a run folder: its checkpoint-final); None when `path`
    is None or no readable drafter folder (an error path's helper: it never raises)."""
    import json

    if path is not None and not is_drafter_folder(path) and is_drafter_folder(Path(path) / "checkpoint-final"):
        path = Path(path) / "checkpoint-final"  # a run folder, as eval's --drafter takes it
    if path is None or not is_drafter_folder(path):
        return None
    try:
        body = json.loads((Path(path) / CONFIG_FILE).read_text())
        return declared_block_size(body, detect_kind(body))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
