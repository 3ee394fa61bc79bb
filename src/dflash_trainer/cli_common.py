"""What every `dflash-train` command module shares: the consoles and the one-line error exit."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console(soft_wrap=True)  # long paths and messages stay on one line in logs
err_console = Console(stderr=True, soft_wrap=True)


def fail(msg: str) -> None:
    """Print `error: msg` on stderr and exit with code 2 (bad input, never a traceback)."""
    err_console.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code=2)
