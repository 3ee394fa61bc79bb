"""`dflash-train`: prepare | train | config | init-config | mixture | export | eval | regenerate | report |
fetch-target | recipe | default-run | bench.

User errors (bad config, bad data, missing files) print one clear line and exit 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_trainer.cli.bench import bench_app
from dflash_trainer.cli.common import TargetOption, Verbose, console, err_console
from dflash_trainer.cli.common import fail as _fail
from dflash_trainer.cli.default_run import default_run_cmd
from dflash_trainer.cli.info import app_options, config_cmd
from dflash_trainer.cli.mixture import mixture_cmd
from dflash_trainer.cli.oom import is_oom, regenerate_oom, train_oom
from dflash_trainer.cli.recipe import recipe_cmd
from dflash_trainer.cli.eval import eval_cmd
from dflash_trainer.cli.export import export_cmd
from dflash_trainer.cli.targets import fetch_target_cmd
from dflash_trainer.telemetry.library_bars import set_library_bars

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train DFlash block drafters for a frozen target model.",
                  callback=app_options)  # --version (cli/info.py)
app.add_typer(bench_app, name="bench")

# Every command checks its flags, paths and settings (preflight/checks.py) before importing torch or
# loading a model, so a bad one is answered in about a second; heavy imports sit in the commands.


def _train_default(field: str) -> str | bool:
    """`show_default` of a train flag: the TrainConfig default (the flags default to None = the
    config's value); False when that is None too (the help text says what None means)."""
    from dflash_trainer.config.schema import field_default

    default = field_default(field)
    return False if default is None else str(default)


@app.command()
def train(
    out: Annotated[Optional[str], typer.Option(help="Run directory.", show_default=_train_default("out"))] = None,
    config: Annotated[Optional[str], typer.Option(help="YAML config file (`dflash-train config > my.yaml` writes one with every field).")] = None,
    target: TargetOption = None,
    data: Annotated[Optional[str], typer.Option(help="Chat data JSON/JSONL (default: embedded ShareGPT).")] = None,
    prepared: Annotated[Optional[str], typer.Option(help="Folder from `dflash-train prepare` (skips preparation).")] = None,
    drafter_config: Annotated[Optional[str], typer.Option(help="Drafter config JSON from `init-config`.")] = None,
    init_from: Annotated[Optional[str], typer.Option(help="Warm start from a drafter folder (checkpoint, zlab or speculators).")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Optimizer steps (unset: optim.epochs passes over the training rows).", show_default=_train_default("max_steps"))] = None,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda", show_default=_train_default("device"))] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for data order, anchors and init.", show_default=_train_default("seed"))] = None,
    log_every: Annotated[Optional[int], typer.Option(help="Steps between metric logs (and progress lines when not on a terminal).", show_default=_train_default("log_every"))] = None,
    no_target_features: Annotated[bool, typer.Option("--no-target-features", help="Zero the target features (control drafter).")] = False,
    resume: Annotated[Optional[str], typer.Option(help="auto (continue OUT's newest checkpoint) | never | a run or checkpoint folder.", show_default=_train_default("resume"))] = None,
    target_gpus: Annotated[Optional[str], typer.Option(help="GPUs running the target, e.g. 0-4 (one process each).")] = None,
    drafter_gpus: Annotated[Optional[str], typer.Option(help="GPUs training the drafter data-parallel, e.g. 5-7.")] = None,
    colocate: Annotated[bool, typer.Option("--colocate", help="Target and drafter in one process (default on one device).")] = False,
    target_procs: Annotated[Optional[int], typer.Option(help="CPU target processes (gloo).")] = None,
    drafter_procs: Annotated[Optional[int], typer.Option(help="CPU drafter processes (gloo).")] = None,
    gpus: Annotated[Optional[str], typer.Option(help="GPUs to split automatically, e.g. 0-7: measures target and drafter speed on this run's rows, runs the fastest split.")] = None,
    procs: Annotated[Optional[int], typer.Option(help="CPU processes to split automatically (gloo).")] = None,
    queue_depth: Annotated[Optional[int], typer.Option(help="Micro-batches each drafter grants ahead.", show_default=_train_default("queue_depth"))] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved process layout as JSON and exit (with --gpus/--procs: after measuring, with every candidate split).")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override any config field: --set data.seq_len=1024 (a bare unique field name also works; `dflash-train config` lists them).")] = None,
    verbose: Verbose = False,
) -> None:
    """Train a drafter: co-located on one device, or target and drafter processes (--target-gpus/--drafter-gpus,
    --target-procs/--drafter-procs, a split measured and chosen by --gpus/--procs, or under torchrun). Writes
    OUT/metrics.jsonl and OUT/checkpoint-final/."""
    set_library_bars(verbose)
    from dflash_trainer.config.load import load_config
    from dflash_trainer.preflight.checks import check_train_config

    try:
        cfg = load_config(config, {"out": out, "target.path": target, "data.chats": data, "data.prepared": prepared,
                                   "drafter.drafter_config": drafter_config, "drafter.init_from": init_from,
                                   "optim.max_steps": max_steps, "runtime.device": device,
                                   "runtime.seed": seed, "runtime.log_every": log_every, "runtime.resume": resume,
                                   "experimental.no_target_features": True if no_target_features else None,
                                   "layout.target_gpus": target_gpus, "layout.drafter_gpus": drafter_gpus,
                                   "layout.colocate": True if colocate else None, "layout.target_procs": target_procs,
                                   "layout.drafter_procs": drafter_procs, "layout.queue_depth": queue_depth,
                                   "layout.gpus": gpus, "layout.procs": procs,
                                   "layout.dry_run": True if dry_run else None}, set_)
        from dflash_trainer.pipeline.auto_split import auto_split_devices, wants_auto_split

        auto = wants_auto_split(cfg)
        if auto:
            auto_split_devices(cfg)
        if not cfg.layout.dry_run or auto:  # a dry run plans a layout, possibly for other machines: no device or path checks
            check_train_config(cfg)  # (unless it measures: --gpus/--procs load the target here)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    from dflash_trainer.pipeline.failed_start import removed_if_start_fails
    from dflash_trainer.pipeline.layout import dry_run_json, is_multiprocess, under_torchrun
    from dflash_trainer.pipeline.launch import PipelineFailed, auto_split_dry_run, run_pipeline
    from dflash_trainer.training.loop import NonFiniteError
    from dflash_trainer.training.run import train as run_train

    # a start that fails before its first checkpoint leaves no run folder (not on torchrun ranks: peers write too)
    with removed_if_start_fails(cfg.out, enabled=not cfg.layout.dry_run and not under_torchrun(os.environ)):
        try:
            if cfg.layout.dry_run and auto:  # the table for people on stderr, stdout stays one JSON document
                body, table = auto_split_dry_run(cfg, err_console)
                err_console.print(table, highlight=False, markup=False)
                print(json.dumps(body, indent=2))
                return
            if cfg.layout.dry_run:
                print(dry_run_json(cfg))  # plain JSON on stdout (machine-readable)
                return
            result = run_pipeline(cfg, console) if auto or is_multiprocess(cfg) else run_train(cfg, console)
        except PipelineFailed as e:  # the launcher already printed the original error once
            raise typer.Exit(code=e.exit_code) from None
        except (ValueError, FileNotFoundError, NonFiniteError, OSError) as e:  # OSError: a full disk or an
            _fail(str(e))  # unwritable output, the message names the path and the size
            return
        except Exception as e:  # a device out of memory: the setting to lower and by how much (cli/oom.py)
            if not is_oom(e):
                raise
            _fail(train_oom(cfg, e))
            return
    if result is None:  # a torchrun rank that does not log
        return
    if result.interrupted:
        console.print(f"stopped by {result.interrupted} at step {result.steps}; checkpoint {result.checkpoint}")
        return
    from dflash_trainer.training.finished import print_summary

    print_summary(result, console)


def _config_default(key: str):
    """A command flag's default that is a config setting's default (`config.schema.field_default`):
    `prepare`'s data settings and init-config's shape flags default as `train` does."""
    from dflash_trainer.config.schema import field_default

    return field_default(key)


@app.command()
def prepare(
    out: Annotated[str, typer.Option(help="Output folder (train/, validation/, prepare_report.json).")],
    data: Annotated[Optional[str], typer.Option(help="Chat data JSON/JSONL (default: embedded ShareGPT).")] = None,
    target: Annotated[Optional[str], typer.Option(help="Target whose tokenizer and chat template are used.")] = None,
    seq_len: Annotated[int, typer.Option(help="T: tokens per packed row.")] = _config_default("data.seq_len"),
    max_conversations: Annotated[Optional[int], typer.Option(help="Read at most this many usable conversations.")] = None,
    validation_fraction: Annotated[float, typer.Option(help="Held-out fraction of conversations.")] = _config_default("data.validation_fraction"),
    seed: Annotated[int, typer.Option(help="Seed of split and packing order.")] = _config_default("runtime.seed"),
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja chat template file (overrides the tokenizer's).")] = None,
    enable_thinking: Annotated[Optional[bool], typer.Option(help="Thinking flag passed to the template.")] = None,
    spec: Annotated[Optional[str], typer.Option(help="Mixture spec YAML: weight --data's records by source (docs/data.md).")] = None,
    workers: Annotated[Optional[int], typer.Option(help="Processes that render and tokenize (default: the usable cores, at most 16); the output is the same for any count.")] = None,
) -> None:
    """Tokenize chats with the target's template, mask all but assistant tokens, pack rows of T tokens."""
    from dflash_trainer.preflight.checks import check_prepare

    try:
        check_prepare(out, data, target, chat_template)
        from dflash_trainer.data.mixture.weights import SourceWeights
        from dflash_trainer.data.prepare import prepare_dataset
        from dflash_trainer.data.sources import default_sharegpt_path
        from dflash_trainer.data.tokenize_pool import default_workers
        from dflash_trainer.target_model.load import load_tokenizer

        if workers is not None and workers < 1:
            raise ValueError(f"--workers {workers}: use 1 or more (1 = this process only)")
        weights = SourceWeights.load(spec, data or str(default_sharegpt_path())) if spec else None  # sources must match
        if weights is not None and weights.missing:
            console.print(f"note: --spec names sources --data lacks: {', '.join(weights.missing)} (their weights "
                          "apply to nothing)", highlight=False, markup=False)
        tok = load_tokenizer(target)
        report = prepare_dataset(data or str(default_sharegpt_path()), tok, Path(out), seq_len=seq_len, weights=weights,
                                 max_conversations=max_conversations, validation_fraction=validation_fraction, seed=seed,
                                 chat_template=Path(chat_template).read_text() if chat_template else None,
                                 enable_thinking=enable_thinking, workers=workers or default_workers())
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # RuntimeError: a conversation or worker failed
        _fail(str(e))
        return
    console.print(f"data: {report.summary_line()}", highlight=False, markup=False)
    console.print(f"wrote {out} (details in {Path(out) / 'prepare_report.json'})", highlight=False)


def _int_list(raw: Optional[str], flag: str) -> Optional[list[int]]:
    if raw is None:
        return None
    try:
        return [int(x) for x in raw.replace(" ", "").split(",") if x]
    except ValueError:
        _fail(f"{flag} {raw!r}: expected comma-separated integers, e.g. 1,8,14,20,27")
        return None


@app.command("init-config")
def init_config_cmd(
    out: Annotated[str, typer.Option(help="Drafter config JSON to write (for `train --drafter-config`).")],
    target: TargetOption = None,
    num_layers: Annotated[int, typer.Option(help="Drafter decoder layers (the paper's 5).")] = _config_default("drafter.num_layers"),
    block_size: Annotated[int, typer.Option(help="B: tokens per block, divides 128 (the paper's 16; 8 common).")] = _config_default("drafter.block_size"),
    layer_types: Annotated[str, typer.Option(help="all-swa | last-full | full | comma list of full/swa.")] = _config_default("drafter.layer_types"),
    sliding_window: Annotated[Optional[int], typer.Option(help="W of sliding layers (default 2048 when a layer slides).")] = None,
    target_layer_ids: Annotated[Optional[str], typer.Option(help="Comma list of target layers (default: the DFlash rule).")] = None,
    num_target_features: Annotated[int, typer.Option(help="k for the default layer rule.")] = _config_default("drafter.num_target_features"),
    mask_token_id: Annotated[Optional[int], typer.Option(help="Mask token row (default: an unused row or spare special token).")] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja template the data will use (default: the tokenizer's).")] = None,
) -> None:
    """Derive a drafter config from the target's config and tokenizer (no weights are read)."""
    from dflash_trainer.preflight.checks import check_init_config

    ids = _int_list(target_layer_ids, "--target-layer-ids")
    try:
        shape, notes = check_init_config(out, target, chat_template, num_layers=num_layers, block_size=block_size,
                                         layer_types=layer_types, sliding_window=sliding_window,
                                         target_layer_ids=ids, num_target_features=num_target_features,
                                         mask_token_id=mask_token_id)
        from dflash_trainer.drafter.shape import drafter_config_from_target, load_target_config, write_drafter_config

        hf_config, tokenizer, name = load_target_config(target)
        dc, info = drafter_config_from_target(
            hf_config, tokenizer, shape, chat_template=Path(chat_template).read_text() if chat_template else None)
        info["notes"] = notes + info["notes"]
        path = write_drafter_config(Path(out), dc, info, name)
    except (ValueError, OSError) as e:  # OSError: unreadable target folder / file
        _fail(str(e))
        return
    for note in info["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"target {name}: {dc.num_target_layers} layers, hidden {dc.hidden_size}, vocab {dc.vocab_size}")
    for need in info["target_needs"]:
        console.print(f"target family: {need}", highlight=False)
    console.print(f"drafter: {dc.num_hidden_layers} layers {dc.layer_types}, B={dc.block_size}, "
                  f"target_layer_ids={dc.target_layer_ids}, window={dc.sliding_window}")
    console.print(f"mask token {dc.mask_token_id} {info['mask_token']!r}: {info['mask_token_reason']}")
    console.print(f"wrote {path}")


app.command("eval")(eval_cmd)  # τ by speculative decoding (cli/eval.py)


@app.command("regenerate")
def regenerate_cmd(
    out: Annotated[str, typer.Option(help="Output file (same format as the input); OUT.report.json holds the counts.")],
    data: Annotated[Optional[str], typer.Option(help="Chat file (ShareGPT or OpenAI-style, JSON or JSONL).")] = None,
    spec: Annotated[Optional[str], typer.Option(help="Mixture spec YAML instead of --data: its prompts are built once into OUT.prompts.jsonl, then answered.")] = None,
    target: TargetOption = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per assistant turn at most (longer ones are counted as truncated).")] = 1024,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 = sampling at this temperature.")] = 0.0,
    enable_thinking: Annotated[Optional[bool], typer.Option("--enable-thinking/--disable-thinking", help="Thinking flag passed to the chat template (default: not passed).")] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja chat template file (default: the tokenizer's; must match serving).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Conversations in flight = rows of the continuous batch (default: 256 on CUDA, 8 on CPU).")] = None,
    max_prompt_tokens: Annotated[int, typer.Option(help="Longest rendered prompt generated for; a longer turn ends its conversation (counted).")] = 2048,
    drop_truncated: Annotated[bool, typer.Option("--drop-truncated", help="End a conversation before any turn cut by --max-new-tokens (keep only finished answers).")] = False,
    max_seconds: Annotated[Optional[float], typer.Option(help="Time budget: take no new conversation after this many seconds (those in flight end after their current turn, cut and counted; the output holds what is done).")] = None,
    max_conversations: Annotated[Optional[int], typer.Option(help="Regenerate at most this many usable conversations.")] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the sampling (T > 0).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus of the sampling (T > 0); 1 = off.")] = 1.0,
    loop_ngram: Annotated[Optional[int], typer.Option(help="Loop guard: stop a turn whose last N tokens already occurred in it (counted as looped; e.g. 32).")] = None,
    samples: Annotated[int, typer.Option(help="Regenerations of each conversation (T > 0); each copy is written with \"sample\": s.")] = 1,
    lookahead: Annotated[int, typer.Option(help="Conversations in flight per batch row; > 1 starts the shortest waiting prompts first (shorter attention spans, faster).")] = 1,
    first_record: Annotated[int, typer.Option(help="Skip the input's records before this index: continue a run that --max-seconds stopped, into a new output (its report's next_record).")] = 0,
    overlap: Annotated[Optional[bool], typer.Option("--overlap/--no-overlap", help="Render the next turns while the GPU runs the next decode steps (default: on CUDA; greedy output is the same, up to bf16 near-ties when rows are scheduled differently).")] = None,
    row_attention: Annotated[Optional[bool], typer.Option("--row-attention/--no-row-attention", help="Each decode step attends every row's own cache slots, not the longest row's span (a Triton kernel; default: on CUDA where it runs, 1.36× the shared span's tok/s on an H100, docs/data.md; bf16 rounding differs, so a greedy near-tie can flip).")] = None,
    verbose: Verbose = False,
) -> None:
    """Replace assistant turns with the target's own responses (resumable: rerun the same command to continue).

    Counts go to OUT.report.json: truncated = turns cut by --max-new-tokens (kept); cut_records / cut_turns =
    conversations ended early because a later turn's prompt exceeded --max-prompt-tokens, or, with
    --drop-truncated, a later turn was cut by --max-new-tokens, or --max-seconds ran out (budget_cut_records;
    answered again in full by a rerun) (the turns dropped); failed_by_reason
    prompt_too_long / truncated = the first turn already was (record not written)."""
    set_library_bars(verbose)
    from dflash_trainer.data.mixture.prompt_cache import regenerate_input
    from dflash_trainer.data.regen_report import regenerate_partial_path
    from dflash_trainer.preflight.checks import check_regenerate

    try:
        if temperature < 0 or max_new_tokens < 1:
            raise ValueError("--temperature must be >= 0 and --max-new-tokens >= 1")
        check_regenerate(data, out, target, chat_template, device)  # with --spec: all but the prompts, built next
        data = regenerate_input(data, spec, out, console)  # --spec: OUT.prompts.jsonl, built or reused
        if Path(out).exists() and not regenerate_partial_path(out).exists():
            console.print(f"{out} is already finished (counts in {out}.report.json); nothing to do. Delete it to "
                          "regenerate again.", highlight=False)
            return
        from dflash_trainer.data.tokenize import resolve_chat_template
        from dflash_trainer.data.regenerate import RegenerateSettings, regenerate_file
        from dflash_trainer.data.responders import TargetResponder
        from dflash_trainer.target_model.load import load_target
        from dflash_trainer.training import precision
        from dflash_trainer.training.run import resolve_device

        dev = resolve_device(device)
        settings = RegenerateSettings(data=data, out=out, target=target, max_new_tokens=max_new_tokens,
                                      temperature=temperature, enable_thinking=enable_thinking,
                                      chat_template=chat_template,
                                      batch_size=batch_size or (256 if dev.type == "cuda" else 8),
                                      max_conversations=max_conversations, seed=seed,
                                      max_prompt_tokens=max_prompt_tokens, max_seconds=max_seconds,
                                      drop_truncated=drop_truncated, top_p=top_p, loop_ngram=loop_ngram,
                                      samples=samples, lookahead=lookahead, first_record=first_record)
        settings.check()
        bundle = load_target(target, device=dev, dtype=precision.compute_dtype(dev))
        template = resolve_chat_template(bundle.tokenizer, Path(chat_template).read_text() if chat_template else None)
        respond = TargetResponder(bundle, template, max_new_tokens=max_new_tokens, temperature=temperature,
                                  enable_thinking=enable_thinking, slots=settings.batch_size,
                                  max_prompt_tokens=max_prompt_tokens, seed=seed, top_p=top_p,
                                  loop_ngram=loop_ngram, shortest_first=lookahead > 1, overlap=overlap,
                                  row_attention=row_attention)
        if respond.fallback:
            console.print(f"note: {respond.fallback}; generating with HF generate in waves of {settings.batch_size}")
        elif row_attention and dev.type != "cuda":
            console.print("note: --row-attention runs its kernel on CUDA only; here its torch reference attends every "
                          "cache slot of every row (slower than without it)", highlight=False)
        report = regenerate_file(settings, respond, console)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    except Exception as e:  # a device out of memory: the batch to lower and by how much (cli/oom.py)
        if not is_oom(e):
            raise
        _fail(regenerate_oom(target, batch_size or 256, max_prompt_tokens, max_new_tokens, e))
        return
    console.print_json(json.dumps(report.__dict__, default=str))
    from dflash_trainer.data.regenerate import input_is_json_array

    skipped = report.skipped_line("record" if input_is_json_array(Path(data)) else "line")
    if skipped:
        console.print(f"warning: {skipped} ({out}.report.json)", highlight=False, markup=False, style="yellow")


@app.command("report")
def report_cmd(
    run_dir: Annotated[str, typer.Argument(help="Run directory (the `out` of train; holds metrics.jsonl).")],
    png: Annotated[Optional[str], typer.Option("--png", help="Where to write the PNG (default RUN_DIR/report.png).")] = None,
) -> None:
    """Plot a run into one PNG: loss (and validation loss), per-position accuracy, τ estimate, tok/s,
    and per-rank GPU busy % for process layouts. Works on a run that is still going."""
    from dflash_trainer.preflight.paths import check_run_dir
    from dflash_trainer.files.writable import check_new_file

    try:
        check_run_dir(run_dir)
        check_new_file(png, "--png")
        from dflash_trainer.telemetry.report import write_report

        path = write_report(run_dir, png)
    except (ValueError, OSError) as e:
        _fail(str(e))
        return
    console.print(f"wrote {path}")


app.command("mixture")(mixture_cmd)  # prompts for `regenerate` (cli/mixture.py)
app.command("export")(export_cmd)  # serving folders (cli/export.py)
app.command("config")(config_cmd)  # every TrainConfig field (cli/info.py)
app.command("fetch-target")(fetch_target_cmd)  # packaged GGUF targets (cli/targets.py)
app.command("recipe")(recipe_cmd)  # target → served drafter in one command (cli/recipe.py)
app.command("default-run")(default_run_cmd)  # `make train`: the recipe on a GPU, else the CPU smoke run


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
