"""`dflash-train config` and `dflash-train --version` (registered in dflash_trainer/cli/main.py): what a
newcomer asks first — which settings exist, what they default to, and which versions run.
Torch-free: both answer in about a second."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import textwrap
from typing import Annotated, Any, Optional

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_trainer.cli.common import console
from dflash_trainer.cli.common import fail as _fail
from dflash_trainer.config.fields import FieldRow, field_rows, matching_rows
from dflash_trainer.config.schema import SECTIONS, flat_config


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def version_line() -> str:
    """`dflash-trainer 0.1.0 (torch …, transformers …, python …)`, read from the installed package
    metadata (nothing is imported)."""
    from dflash_trainer import __version__

    own = _version("dflash-trainer") or __version__
    deps = ", ".join(f"{pkg} {_version(pkg) or 'not installed'}" for pkg in ("torch", "transformers"))
    return f"dflash-trainer {own} ({deps}, python {platform.python_version()})"


def _print_version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit()


def app_options(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print the dflash-trainer, torch and transformers versions and exit.")] = False,
) -> None:
    """Options of `dflash-train` itself (before the command). Every command starts quiet: the
    loaders' progress bars and torchao's import noise off (`set_library_bars`); the commands with
    --verbose turn the bars back on."""
    from dflash_trainer.telemetry.library_bars import set_library_bars

    set_library_bars(False)


def _show(value: Any) -> str:
    return "None" if value is None else str(value)


def _yaml_value(name: str, value: Any) -> str:
    return yaml.safe_dump({name: value}, default_flow_style=True, sort_keys=False, width=10**6).strip()[1:-1]


def _section_line(section: str) -> str:
    """What a section holds, in one line (str): the first paragraph of its class docstring."""
    first = " ".join((SECTIONS[section].__doc__ or "").split("\n\n")[0].split())
    return first.split(": ", 1)[-1]


def render_yaml(rows: list[FieldRow], values: dict[str, Any] | None = None) -> str:
    """Plain text (str): a YAML config file with every setting in `rows` (the value, or the
    default), nested by section, each under a comment with its type and description. `--config`
    accepts it as is. values: resolved settings keyed `section.field` (`flat_config`)."""
    lines: list[str] = []
    group = None
    for r in rows:
        indent = "  " if r.group else ""
        if r.group != group:
            group = r.group
            if r.group:
                doc = _section_line(r.group)
                lines += ([""] if lines else []) + [f"# --- {r.group}: {doc}", f"{r.group}:"]
        value = values[r.name] if values is not None else r.default
        note = f" (default {_show(r.default)})" if values is not None and value != r.default else ""
        lines += textwrap.wrap(f"[{r.type}]{note} {r.description}", width=100, initial_indent=f"{indent}# ",
                               subsequent_indent=f"{indent}#   ")
        lines.append(indent + _yaml_value(r.field, value))
    return "\n".join(lines) + "\n"


def render_table(rows: list[FieldRow], out: Console, values: dict[str, Any] | None = None) -> None:
    """A rich table per section (printed to `out`): setting, type, default (and the resolved value),
    description. values: resolved settings keyed `section.field`."""
    group_rows: dict[str, list[FieldRow]] = {}
    for r in rows:
        group_rows.setdefault(r.group, []).append(r)
    for group, members in group_rows.items():
        title = f"{group}: {_section_line(group)}" if group else "run folder"
        table = Table(title=escape(title), title_justify="left", title_style="bold", expand=True)
        table.add_column("setting", style="cyan", no_wrap=True)
        table.add_column("type", no_wrap=True)
        table.add_column("default")
        if values is not None:
            table.add_column("value")
        table.add_column("description", ratio=1)
        for r in members:
            cells = [r.name, escape(r.type), escape(_show(r.default))]
            if values is not None:
                v = values[r.name]
                cells.append(f"[bold yellow]{escape(_show(v))}[/]" if v != r.default else escape(_show(v)))
            table.add_row(*cells, escape(r.description))
        out.print(table)


def config_cmd(
    word: Annotated[Optional[str], typer.Argument(help="A section (optim, data, ...) to show alone, or show only fields "
                                                       "whose name or description contains WORD, or that WORD names in "
                                                       "other trainers (learning_rate → optim.lr).")] = None,
    config: Annotated[Optional[str], typer.Option(help="YAML config file: also show the values it resolves to.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="section.field=value overrides to resolve, as for train.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list of {group, name, type, default, "
                                                          "description[, value]} (for scripts).")] = False,
) -> None:
    """List every training config field (`train --config FILE`, `--set section.field=value`) with its type, default
    and description, by section. On a terminal: tables; piped: a YAML config file with every field
    and comments (`dflash-train config > my.yaml`, edit, `train --config my.yaml`)."""
    values = None
    if config or set_:
        from dflash_trainer.config.load import load_config

        try:
            values = flat_config(load_config(config, None, set_).model_dump())
        except ValueError as e:
            _fail(str(e))
            return
    rows = matching_rows(field_rows(), word or "")
    if not rows:
        _fail(f"no config field matches {word!r}; run `dflash-train config` without a word to list them all")
        return
    if json_out:
        body = [{**r.__dict__, "field": r.field, **({"value": values[r.name]} if values is not None else {})} for r in rows]
        print(json.dumps(body, indent=2))
    elif console.is_terminal:
        render_table(rows, console, values)
    else:
        print(render_yaml(rows, values), end="")
