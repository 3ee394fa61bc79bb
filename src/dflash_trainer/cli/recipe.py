"""`dflash-train recipe` (registered in dflash_trainer/cli/main.py): mixture → regenerate → prepare → train
(→ control) → eval → export → report, sized to the machine, each stage a child `dflash-train` command,
rerun-safe (docs/recipe.md)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from dflash_trainer.cli.common import TargetOption, console
from dflash_trainer.cli.common import fail as _fail


def _plan_table(plan) -> Table:
    t = Table(title=f"recipe plan ({plan.device}" + (f", {plan.gpu_memory_gib:.0f} GiB" if plan.gpu_memory_gib else "") + ")")
    t.add_column("setting")
    t.add_column("value", justify="right")
    t.add_column("why")
    for name in ("seq_len", "feature_cache_gib", "regen_batch_rows", "regen_max_seconds", "regen_max_conversations",
                 "eval_batch", "eval_max_prompts", "eval_dtype", "block_size", "rows_per_step", "steps"):
        value = getattr(plan, name)
        t.add_row(name, "-" if value is None else str(value), plan.reasons.get(name, ""))
    for stage, s in plan.stage_seconds.items():
        t.add_row(f"time: {stage}", f"{s / 60:.1f} min", plan.reasons.get(f"time: {stage}", "estimate"))
    t.add_row("time: total", f"{plan.total_seconds() / 60:.1f} min", "")
    return t


def recipe_cmd(
    out: Annotated[str, typer.Option(help="Run folder: stages/, logs/, data, drafter, evals, exports, REPORT.md.")],
    target: TargetOption = None,
    spec: Annotated[Optional[str], typer.Option(help="Prompt mixture spec YAML (default: the packaged configs/mixture-smollm2.yaml).")] = None,
    data: Annotated[Optional[str], typer.Option(help="Chat file whose prompts the target answers, instead of a mixture.")] = None,
    control: Annotated[bool, typer.Option("--control", help="Also train and evaluate the no-target-features control.")] = False,
    hours: Annotated[Optional[float], typer.Option(help="Time for the whole recipe: sets the regeneration budget and the steps.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Training steps (overrides --hours for training).")] = None,
    plan_only: Annotated[bool, typer.Option("--plan", help="Print the plan and the time per stage; run nothing.")] = False,
    gpu_memory_gib: Annotated[Optional[float], typer.Option(help="Plan for a card with this much free memory (GiB; 0 = CPU).")] = None,
    config: Annotated[Optional[str], typer.Option(help="Train config YAML (the plan's --set flags and yours override it).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Train override, e.g. --set optim.lr=1e-3 (also data.seq_len for prepare).")] = None,
    until: Annotated[Optional[str], typer.Option(help="Stop after this stage (mixture, regenerate, prepare, train, control, eval, export, report).")] = None,
    plan_json: Annotated[Optional[str], typer.Option(help="With --plan: also write the plan (every number, its reason, the time per stage) to this JSON file.")] = None,
    regen_samples: Annotated[int, typer.Option(help="Answers the target writes per conversation (> 1 needs --regen-temperature); the plan sizes the data, regeneration time and cache for all of them.")] = 1,
    regen_temperature: Annotated[float, typer.Option(help="Sampling temperature of the regeneration (0 = greedy, the measured recipe).")] = 0.0,
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja chat template file for a target whose tokenizer has none (or another than serving uses): regenerate, prepare and train render with it; the exports record it.")] = None,
    verifier: Annotated[Optional[str], typer.Option(help="The target's name in the exports (a hub id, or the path where it is served), for a target whose files do not say its hub id.")] = None,
) -> None:
    """From a target to a served drafter in one command; a rerun skips finished stages and resumes a killed one."""
    from dflash_trainer.recipe.settings import RecipeSettings

    from dflash_trainer.preflight.paths import check_chat_file, check_target

    try:
        from dflash_trainer.recipe.inputs import EMBEDDED_NAMES, check_target_weights

        if not (plan_only and target in EMBEDDED_NAMES):  # the embedded target's plan needs none of its files
            check_target(target)
        if not plan_only and until != "mixture":  # a plan needs the config only; the run needs the weights
            check_target_weights(target)
        check_chat_file(data)
        settings = RecipeSettings(out=out, target=target, spec=spec, data=data, control=control, hours=hours,
                                  steps=steps, gpu_memory_gib=gpu_memory_gib, config=config, sets=list(set_ or []),
                                  until=until, regen_samples=regen_samples, regen_temperature=regen_temperature,
                                  chat_template=chat_template, verifier=verifier)
        settings.check()
        from dflash_trainer.recipe.inputs import check_target_layers, data_size, spec_data_size, target_shape
        from dflash_trainer.recipe.machine import free_gpu_gib
        from dflash_trainer.recipe.plan import make_plan

        k = settings.user_set("drafter.num_target_features", "num_target_features")
        seq = settings.user_set("data.seq_len", "seq_len")
        block = settings.user_set("drafter.block_size", "block_size")
        anchors = settings.user_set("loss.num_anchors", "num_anchors")
        device = settings.user_set("runtime.device", "device")
        free = (gpu_memory_gib or None) if gpu_memory_gib is not None else free_gpu_gib(device)
        # the plan must not depend on what a run folder holds: a rerun would get other steps, a new train key
        # and a training from scratch
        shape = target_shape(target, int(k) if k else 5)
        size, spec_warning = (data_size(data), None) if data else spec_data_size(spec)
        def plan_for(free_gib):
            return make_plan(free_gib, shape, size, hours=hours, steps=steps,
                             control=control, seq_len=int(seq) if seq else None, mixture_done=bool(data),
                             block_size=int(block) if block else None, num_anchors=int(anchors) if anchors else None,
                             samples=regen_samples)

        plan = plan_for(free)
        plan.warnings += [spec_warning] if spec_warning else []
        from dflash_trainer.config.load import load_config
        from dflash_trainer.recipe.stages import train_sets

        # the train stage's config now, not after the regeneration: a misspelt --set fails in a second, and
        # what the config warns of (a setting the others make void) is said with the plan's warnings
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                cfg = load_config(config, sets=train_sets(plan, settings))
            except ValueError as e:
                raise ValueError(f"the train stage would refuse its config: {e}") from None
        plan.warnings += [f"train config: {w.message}" for w in said]
        check_target_layers(shape.layers, cfg.drafter.num_target_features, cfg.drafter.target_layer_ids)
        from dflash_trainer.recipe.inputs import verifier_warning

        if settings.until is None or settings.stages()[-1] in ("export", "report"):  # no export, nothing to name
            plan.warnings += verifier_warning(target, verifier)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
        return
    if plan.device == "cpu":
        console.print(f"[recipe] {plan.reasons['device']}; on a GPU host the same command plans the real run",
                      highlight=False, markup=False)
    for line in plan.warnings:
        console.print(f"[recipe] plan: warning: {line}", highlight=False, markup=False)
    if plan_only:
        console.print(_plan_table(plan))
        if plan_json:
            from dflash_trainer.recipe.records import write_json_atomic

            write_json_atomic(Path(plan_json), {**plan.as_dict(), "total_seconds": plan.total_seconds()})
        return
    from dflash_trainer.recipe.child import StageFailed, Stopped
    from dflash_trainer.recipe.run import run_recipe

    try:
        run_recipe(settings, plan, console)
    except Stopped as e:
        console.print(f"[recipe] {e}", highlight=False, markup=False)
        raise typer.Exit(code=e.exit_code) from None
    except StageFailed as e:
        from dflash_trainer.recipe.oom import recipe_oom_advice

        text = e.log.read_text(errors="replace") if e.log.exists() else ""
        header = text.rfind("\n$ dflash-train ")  # the failed command's output only (the log is appended to)
        last = text[header:] if header >= 0 else text

        def batch_at(gib: float):  # the failed stage's batch in the plan for a card of `gib` GiB
            try:
                p = plan_for(gib)
            except ValueError:  # too small a card for any plan
                return None
            return p.regen_batch_rows if e.stage == "regenerate" else p.eval_batch

        advice = recipe_oom_advice(e.stage, last, plan.gpu_memory_gib, batch_at)
        _fail(f"{e}\n{advice}" if advice else str(e))
        return
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    done = f"{out}/REPORT.md" if until in (None, "report") else f"stopped after {until} as asked (--until); {out}"
    if until in (None, "report") and (Path(out) / "report.json").is_file():
        import json

        from dflash_trainer.recipe.report import console_summary

        try:
            summary = console_summary(json.loads((Path(out) / "report.json").read_text()))
        except (ValueError, TypeError, KeyError, AttributeError, OSError):  # an odd report.json: REPORT.md has it all
            summary = []
        for line in summary:
            console.print(f"[recipe] {line}", highlight=False, markup=False)
    console.print(f"[recipe] done: {done}", highlight=False, markup=False)
