"""`dflash-train eval` (registered in dflash_trainer/cli/main.py): the acceptance length τ of a drafter by
real speculative decoding with the target, and the lossless check. Imports only typer here; the
settings check and the decoding load when the command runs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_trainer.cli.common import TargetOption, Verbose, console
from dflash_trainer.cli.common import fail as _fail
from dflash_trainer.cli.oom import eval_oom, is_oom
from dflash_trainer.telemetry.library_bars import set_library_bars


def eval_cmd(
    drafter: Annotated[str, typer.Option(help="Drafter folder: checkpoint (or run folder), zlab or speculators export.")],
    target: TargetOption = None,
    dataset: Annotated[str, typer.Option(help="mt-bench | humaneval | sharegpt-heldout | a JSON/JSONL chat file.")] = "mt-bench",
    max_prompts: Annotated[Optional[int], typer.Option(help="Evaluate the first N prompts; 0 = all (default: all on GPU; on CPU 2 — at 128 new tokens a 2-turn prompt costs 55-105 s with SmolLM2 on 2 cores).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Tokens generated per turn at most (default: 256; on CPU 128).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy (lossless check); > 0 = speculative sampling.")] = 0.0,
    block_size: Annotated[Optional[int], typer.Option(help="B at inference (≤ the trained B; default: trained B).")] = None,
    max_turns: Annotated[Optional[int], typer.Option(help="User turns per prompt (default: all; MT-Bench has 2).")] = None,
    max_prompt_tokens: Annotated[int, typer.Option(help="Skip a turn whose prompt has more tokens (and its conversation's later turns); counted in the result's `skipped`.")] = 2048,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the result JSON here (and a PNG next to it).")] = None,
    plot: Annotated[Optional[str], typer.Option(help="PNG of the per-position acceptance (default: JSON path with .png).")] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the sampling draws (T > 0).")] = 0,
    offline: Annotated[bool, typer.Option(help="Also compute the offline τ on the same prompts.")] = True,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (batch-1 decoding is latency-bound; 1 is often fastest on a shared CPU).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Turns decoded at once (default: 256 on CUDA, 1 on CPU).")] = None,
    cuda_graph: Annotated[bool, typer.Option(help="On CUDA: replay each decode step / speculative round from a CUDA graph.")] = True,
    batch_sizes: Annotated[Optional[str], typer.Option(help="Also a speedup table over these batch sizes, e.g. 1,4,16,64,256: speculative against plain decoding of the first turns in continuous batches of that size (JSON + PNG curve), with the draft length chosen per batch size (docs/eval.md).")] = None,
    dtype: Annotated[str, typer.Option(help="Target dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 (exact lossless check) | bfloat16.")] = "auto",
    verbose: Verbose = False,
) -> None:
    """Measure the acceptance length τ by real speculative decoding with the target (and check losslessness at T=0).
    Prints a line per decoded batch (per turn at batch 1, the CPU default: tokens, tok/s, τ so far, ETA) and a heartbeat
    every 10 s; on CPU the defaults (2 prompts, 128 new tokens) took 1 min 49 s to 2.5 min with the embedded SmolLM2 on 2
    cores (up to ~4.5 min when the cores are shared)."""
    set_library_bars(verbose)
    from dflash_trainer.evaluation.settings import EvalSettings, check_eval_settings, parse_batch_sizes

    try:
        settings = EvalSettings(drafter=drafter, target=target, dataset=dataset, max_prompts=max_prompts,
                                max_new_tokens=max_new_tokens, temperature=temperature, block_size=block_size,
                                max_turns=max_turns, max_prompt_tokens=max_prompt_tokens, json_out=json_out, plot_out=plot, device=device, seed=seed,
                                offline=offline, threads=threads, batch_size=batch_size, cuda_graph=cuda_graph,
                                batch_sizes=parse_batch_sizes(batch_sizes), dtype=dtype)
        check_eval_settings(settings)
        from dflash_trainer.evaluation.run import run_eval

        r = run_eval(settings, console)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    except Exception as e:  # a device out of memory: the batch to lower and by how much (cli/oom.py)
        if not is_oom(e):
            raise
        _fail(eval_oom(settings, e))
        return

    def fmt(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}"

    console.print("\n[bold]eval[/]")
    console.print(f"  τ {fmt(r['tau'])} over {r['rounds']} rounds, {r['tokens']} tokens ({r['num_prompts']} prompts, "
                  f"{r['num_turns']} turns, B={r['block_size']}, T={r['temperature']})")
    if "offline_tau_exact" in r:
        console.print(f"  offline τ exact {fmt(r['offline_tau_exact'])}, estimate {fmt(r['offline_tau_estimate'])}, "
                      f"at decoding's anchors {fmt(r.get('offline_tau_walk'))}")
    from dflash_trainer.decoding.committed import breakdown_line

    if line := breakdown_line(r.get("tau_breakdown") or {}):
        console.print(f"  τ: {line}", highlight=False)
    console.print(f"  conditional acceptance per position: [{', '.join(fmt(c) for c in r['conditional_accept_per_position'])}]")
    from dflash_trainer.evaluation.speedup import choice_sentence, speed_sentence

    console.print(f"  speculative {r['speculative_tokens_per_s']:.1f} tok/s, plain {r['target_tokens_per_s']:.1f} tok/s "
                  f"(batch {r['batch_size']}, target {r['target_dtype']}): {speed_sentence(r['speedup'])}")
    for row in r.get("speedup_table", []):
        console.print(f"    batch {row['batch_size']:>4}: speculative {row['speculative_tokens_per_s']:,.1f} tok/s, plain "
                      f"{row['plain_tokens_per_s']:,.1f} tok/s, τ {fmt(row['tau'])}: {speed_sentence(row['speedup'])}; "
                      f"chosen {choice_sentence(row)}")
    if r["lossless"] is None:
        console.print("  lossless: not checked (T > 0)")
    else:
        bf16 = (" (bfloat16 rounding can flip near-ties between the plain step and the verify pass; "
                "--dtype float32 checks exactness)") if r["mismatches"] and r["target_dtype"] != "float32" else ""
        console.print(f"  lossless: {str(r['lossless']).lower()}" + (f" ({len(r['mismatches'])} mismatching turns)"
                                                                     if r["mismatches"] else "") + bf16)
    for path in (json_out, r.get("plot"), r.get("speedup_plot")):
        if path:
            console.print(f"  wrote {path}")
