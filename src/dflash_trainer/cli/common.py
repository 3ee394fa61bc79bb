"""What every `dflash-train` command module shares: the consoles, the one-line error exit, `--verbose`, `--target`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

# The flag of every command that loads a model (see telemetry/library_bars.py).
Verbose = Annotated[bool, typer.Option("--verbose", help="Show the progress bars of transformers, the GGUF "
                                                         "converter and datasets while loading (off: they flood logs).")]

# The target of every command that loads one (target_model/paths.py resolves it; packaged names: packaged_targets.py).
TargetOption = Annotated[Optional[str], typer.Option(help="Target: HF folder, .gguf file or a name: smollm2-135m, "
                                                          "qwen2.5-coder-0.5b, gemma3-270m (default: embedded SmolLM2).")]

console = Console(soft_wrap=True)  # long paths and messages stay on one line in logs
err_console = Console(stderr=True, soft_wrap=True)


def fail(msg: str) -> None:
    """Print `error: msg` on stderr and exit with code 2 (bad input, never a traceback)."""
    err_console.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code=2)
