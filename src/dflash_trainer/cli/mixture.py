"""`dflash-train mixture`: spec file → prompts JSONL + report (registered in dflash_trainer/cli/main.py).
Imports only typer here; the build is imported when the command runs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_trainer.cli.common import console
from dflash_trainer.cli.common import fail as _fail


def mixture_cmd(
    spec: Annotated[str, typer.Option(help="Mixture spec YAML (e.g. configs/mixture-smollm2.yaml; format in docs/data.md).")],
    out: Annotated[str, typer.Option(help="Output JSONL of OpenAI-style records; OUT.report.json holds the per-source report.")],
    workers: Annotated[Optional[int], typer.Option(
        help="Processes for the math generator (default: the spec's `workers`) and for parsing the code source's "
             "packages (default: 1); 1 … 16 (the spec's cap, MAX_WORKERS), the records do not depend on it (the recipe "
             "passes its CPUs, at most 16).")] = None,
) -> None:
    """Build a prompt mixture for `regenerate` from offline PyPI data (ShareGPT, math, chitchat, code, evals), with no
    MT-Bench / HumanEval text and none of the held-out ShareGPT conversations."""
    from dflash_trainer.data.mixture.spec import MAX_WORKERS, load_spec
    from dflash_trainer.files.writable import check_new_file

    try:
        if workers is not None and not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"--workers {workers}: give 1 … {MAX_WORKERS} math generator processes (or leave it out: "
                             "the spec's)")
        parsed = load_spec(spec)
        check_new_file(out, "--out")
        from dflash_trainer.data.mixture.build import build_mixture, summary_lines, write_mixture

        mix = build_mixture(parsed, log=lambda line: console.print(f"  {line}", highlight=False), math_workers=workers)
        report_file = write_mixture(mix, out)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    for line in summary_lines(mix.report):
        console.print(line, highlight=False)
    console.print(f"wrote {out} ({mix.report.output['bytes'] / 1e6:.1f} MB) and {report_file}", highlight=False)
