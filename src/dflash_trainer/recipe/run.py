"""Run the recipe: each stage in order, skipped when its finished record's hash matches its key, resumed
when its started record matches (work left by a killed run), redone otherwise (its outputs removed
first); a redone stage changes its hash, so every stage downstream is redone too."""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console

from dflash_trainer.recipe import stages as st
from dflash_trainer.recipe import stages_late as late
from dflash_trainer.recipe.plan import Plan
from dflash_trainer.recipe.progress import RecipeProgress
from dflash_trainer.recipe.records import StageRecords, key_hash, recorded_form, write_json_atomic
from dflash_trainer.recipe.settings import RecipeSettings, RunPaths

Stage = tuple[Callable[[st.Context], dict[str, Any]], Callable[[st.Context, bool], dict[str, Any]], str]

STAGE_TABLE: dict[str, Stage] = {
    "mixture": (st.mixture_key, st.mixture_run, "build the prompt mixture"),
    "regenerate": (st.regen_key, st.regen_run, "the target answers the prompts"),
    "prepare": (st.prepare_key, st.prepare_run, "tokenize and pack rows"),
    "train": (st.train_key, st.train_run, "train the drafter"),
    "control": (lambda c: st.train_key(c, True), lambda c, r: st.train_run(c, r, control=True),
                "train the no-target-features control"),
    "eval": (late.eval_key, late.eval_run, "measured τ on MT-Bench, HumanEval, held-out ShareGPT"),
    "export": (late.export_key, late.export_run, "export zlab and speculators folders"),
    "report": (late.report_key, late.report_run, "report.json, report.png, REPORT.md"),
}


def run_recipe(settings: RecipeSettings, plan: Plan, console: Console) -> dict[str, str]:
    """Run (or skip, resume, redo) every stage; returns stage → what happened (skipped / resumed / ran /
    continued). Raises recipe.child.StageFailed when a command fails, Stopped when a signal stopped it."""
    paths = RunPaths(settings.out)
    paths.root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.root / "plan.json", plan.as_dict())
    records = StageRecords(paths.root)
    ctx = st.Context(settings, plan, paths)
    names = settings.stages()
    progress = RecipeProgress(console, {s: plan.stage_seconds.get(s, 0.0) for s in names})
    ctx.heartbeat = progress.tick
    ctx.say = lambda line: console.print(line, highlight=False, markup=False)
    what: dict[str, str] = {}
    try:
        for name in names:
            key_fn, run_fn, text = STAGE_TABLE[name]
            key = key_fn(ctx)
            done, started = records.finished(name), records.started(name)
            key = recorded_form(key, done, started)
            h = key_hash(key)
            if done and done.get("hash") == h:
                ctx.hashes[name] = h
                what[name] = "skipped"
                progress.skip(name, "finished with the same inputs, skipped")
                continue
            if name == "regenerate" and done and st.regen_reusable(ctx, done):
                ctx.hashes[name] = done["hash"]  # its answers are what the stages downstream were keyed on
                what[name] = "skipped"
                progress.skip(name, f"every prompt answered at other batch rows / time cap "
                                    f"({done['key'].get('batch_size')} rows): reused")
                continue
            t0 = time.monotonic()
            if name == "regenerate" and done:
                outputs = st.regen_continue(ctx, done)
                if outputs is not None:
                    progress.begin(name, f"continuing the earlier regeneration from record {outputs['continued_from']}")
                    records.finish(name, key, time.monotonic() - t0, outputs)
                    ctx.hashes[name], what[name] = h, "continued"
                    progress.end(name, time.monotonic() - t0)
                    continue
            resuming = bool(started and started.get("hash") == h)
            progress.begin(name, ("resuming: " if resuming else "") + text + (" (inputs changed: redone)" if done else ""))
            records.start(name, key)
            outputs = run_fn(ctx, resuming)
            seconds = time.monotonic() - t0
            records.finish(name, key, seconds, outputs)
            ctx.hashes[name] = h
            what[name] = "resumed" if resuming else "ran"
            progress.end(name, seconds)
    finally:
        progress.close()
    if all(v == "skipped" for v in what.values()):
        console.print(f"[recipe] every stage of {paths.root} is finished with the same inputs: nothing to redo",
                      highlight=False, markup=False)
    return what
