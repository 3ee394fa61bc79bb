"""`dflash-train export` (registered in dflash_trainer/cli/main.py): a drafter folder → a folder serving
engines load as is. Imports only typer here; torch and the writers load when the command runs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_trainer.cli.common import console
from dflash_trainer.cli.common import fail as _fail


def export_cmd(
    source: Annotated[str, typer.Argument(help="Drafter folder: a checkpoint, or a zlab / speculators export.")],
    fmt: Annotated[str, typer.Option("--format", help="zlab (z-lab, SGLang, vLLM) | speculators (vLLM).")],
    out: Annotated[str, typer.Option(help="New folder to write.")],
    dtype: Annotated[str, typer.Option(help="keep | bfloat16 | float16 | float32")] = "keep",
    target: Annotated[Optional[str], typer.Option(help="Target whose tokenizer names the mask token and whose config "
                                                       "names the verifier (default: the one recorded).")] = None,
    verifier: Annotated[Optional[str], typer.Option(help="Verifier name_or_path written in the export: a hub id "
                                                         "(e.g. Qwen/Qwen3-8B) or the path where the target is served "
                                                         "(default: the target's hub id when known — the embedded "
                                                         "SmolLM2 is HuggingFaceTB/SmolLM2-135M-Instruct, an HF "
                                                         "folder's _name_or_path — else its folder name, with a "
                                                         "warning).")] = None,
    read_target: Annotated[bool, typer.Option(help="Read the target's tokenizer/config (mask token name, verifier).")] = True,
    speedup_from: Annotated[Optional[str], typer.Option(help="Result JSON of `eval --batch-sizes ... --json FILE`: its "
                                                             "draft length per batch size goes into speculation.json "
                                                             "(default: only the maximum, B−1).")] = None,
) -> None:
    """Write a drafter folder serving engines load: config.json, model.safetensors, chat_template.jinja, and
    speculation.json (the draft length to serve per batch size, with --speedup-from; docs/formats.md).
    A speculators export is served as is by `vllm serve OUT` (vLLM loads the verifier it names)."""
    from dflash_trainer.interop.formats import check_verifier
    from dflash_trainer.interop.speculation import read_speedup_eval
    from dflash_trainer.preflight.checks import check_export

    try:
        check_export(source, fmt, dtype, out, target, read_target)
        check_verifier(verifier)
        if speedup_from is not None:
            read_speedup_eval(speedup_from)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    from dflash_trainer.interop.export import DTYPES, export_drafter

    try:
        path, meta, notes = export_drafter(source, fmt, out, dtype=None if dtype == "keep" else DTYPES[dtype],
                                           target=target, read_target=read_target, verifier=verifier,
                                           speedup_from=speedup_from)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(f"exported {meta['kind']} {source} → {fmt} {path} (chat template "
                  f"{'recorded' if meta.get('chat_template') else 'unknown'}, enable_thinking={meta.get('enable_thinking')})")
    side = (f"draft length per batch size from {speedup_from}" if speedup_from else
            "the maximum draft length only (--speedup-from EVAL.json adds the per-batch-size table)")
    console.print(f"  speculation.json: {side}", highlight=False)
