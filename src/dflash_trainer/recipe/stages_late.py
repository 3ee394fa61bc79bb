"""The recipe's last stages: eval (every trained run on each suite), export (zlab and speculators) and
report (recipe/report.py, in this process). Keys as in recipe/stages.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from dflash_trainer.recipe.child import StageFailed
from dflash_trainer.recipe.records import file_digest
from dflash_trainer.recipe.report import write_report
from dflash_trainer.recipe.settings import SUITES
from dflash_trainer.recipe.stages import EXPORT_FORMATS, Context, _rm

SPEEDUP_BATCH_SIZES = (1, 4, 16, 64, 256)  # the speedup table's batch sizes on a GPU, up to the plan's eval batch


def runs(ctx: Context) -> list[str]:
    return ["drafter", *(["control"] if ctx.settings.control else [])]


def eval_settings(ctx: Context) -> dict[str, Any]:
    p = ctx.plan
    return {"max_prompts": p.eval_max_prompts, "max_new_tokens": p.eval_max_new_tokens, "batch_size": p.eval_batch,
            "device": p.device, "suites": list(SUITES), "max_turns": 1 if p.device == "cpu" else None,
            "dtype": p.eval_dtype, "heldout_max_prompts": p.heldout_max_prompts, "heldout_max_turns": p.heldout_max_turns,
            "speedup": speedup_settings(ctx)}


def speedup_settings(ctx: Context) -> dict[str, Any]:
    """The drafter's speedup table (evaluation/speedup.py: plain against speculative decoding per batch size,
    the draft length chosen per batch size) on MT-Bench's first turns: on a GPU at SPEEDUP_BATCH_SIZES up to the
    plan's eval batch (what fits half the card) with a bf16 target, as it is served; on CPU at batch 1 in the
    eval's dtype (the tiny plan's smoke of the path)."""
    gpu = ctx.plan.device == "cuda"
    sizes = [b for b in SPEEDUP_BATCH_SIZES if b <= max(1, ctx.plan.eval_batch)] if gpu else [1]
    return {"suite": "mt-bench", "batch_sizes": ",".join(map(str, sizes)),
            "dtype": "bfloat16" if gpu else ctx.plan.eval_dtype}


def suite_limits(s: dict[str, Any], suite: str) -> tuple[Any, Any]:
    """(max prompts, max turns) of one suite: the held-out ShareGPT slice has its own (3,000 multi-turn
    conversations would outlast the rest of the recipe), the others the plan's."""
    if suite == "sharegpt-heldout" and s.get("heldout_max_prompts"):
        return s["heldout_max_prompts"], s.get("heldout_max_turns") or s["max_turns"]
    return s["max_prompts"], s["max_turns"]


def eval_key(ctx: Context) -> dict[str, Any]:
    return {"train": ctx.hashes["train"], "control": ctx.hashes.get("control"), **eval_settings(ctx)}


def eval_run(ctx: Context, resuming: bool) -> dict[str, Any]:
    """Each run on each suite into RUN/eval/<run>-<suite>.json; resuming keeps the JSONs already written."""
    if not resuming:  # an earlier drafter's JSONs (the suites' and the speedup table) would be kept as this one's
        _rm(ctx.paths.eval, ctx.paths.speedup.parent)
    ctx.paths.eval.mkdir(parents=True, exist_ok=True)
    s = eval_settings(ctx)
    done = {}
    for run in runs(ctx):
        for suite in SUITES:
            out = ctx.paths.eval / f"{run}-{suite}.json"
            done[f"{run}/{suite}"] = str(out)
            if not out.exists():
                ctx.run("eval", _eval_args(ctx, s, run, suite, out, s["dtype"]))
    done["drafter/speedup"] = speedup_run(ctx, s)
    return done


def _eval_args(ctx: Context, s: dict[str, Any], run: str, suite: str, out: Path, dtype: str,
               max_turns: Optional[int] = None) -> list[str]:
    """The `eval` command of `run`'s checkpoint on `suite` into `out` at the eval settings `s`, in `dtype`;
    the suite's limits (suite_limits), its turns lowered to `max_turns` when given."""
    prompts, turns = suite_limits(s, suite)
    turns = max_turns or turns
    args = ["eval", "--drafter", str(ctx.paths.checkpoint(run)), *ctx.target_args(), "--dataset", suite,
            "--json", str(out), "--max-new-tokens", str(s["max_new_tokens"]), "--batch-size", str(s["batch_size"]),
            "--device", s["device"], "--dtype", dtype]
    if prompts:
        args += ["--max-prompts", str(prompts)]
    if turns:
        args += ["--max-turns", str(turns)]
    threads = ctx.settings.user_set("runtime.threads", "threads")  # train's CPU threads, for eval too (not keyed:
    if threads:  # the threads change no result)
        args += ["--threads", threads]
    return args


def speedup_run(ctx: Context, s: dict[str, Any]) -> str:
    """The drafter's speedup table into RUN/speedup/drafter-mt-bench.json (export's --speedup-from); returns its
    path, or "failed: ..." when that eval failed: the τ of every suite is measured by then, so the recipe goes
    on, says so, and exports without the table (the sidecar then records B − 1 only)."""
    sp, out = s["speedup"], ctx.paths.speedup
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args = _eval_args(ctx, s, "drafter", sp["suite"], out, sp["dtype"], max_turns=1)
    try:
        ctx.run("eval", [*args, "--batch-sizes", sp["batch_sizes"]])
    except StageFailed as e:
        out.unlink(missing_ok=True)
        ctx.say(f"[recipe] eval: the speedup table failed, so the export has no per-batch-size draft lengths: {e}")
        return f"failed: {e}"
    return str(out)


def export_key(ctx: Context) -> dict[str, Any]:
    """The drafter's training, the speedup table's digest (None without one) and --verifier when given: a
    table written after a failed one (by hand, `eval --batch-sizes ... --json RUN/speedup/drafter-mt-bench.json`)
    or another --verifier redoes the export."""
    table = file_digest(ctx.paths.speedup) if ctx.paths.speedup.exists() else None
    key = {"train": ctx.hashes["train"], "formats": list(EXPORT_FORMATS), "speedup": table}
    if ctx.settings.verifier:  # only when given: exports recorded before the flag keep their key
        key["verifier"] = ctx.settings.verifier
    return key


def export_run(ctx: Context, resuming: bool) -> dict[str, Any]:
    done = {}
    speedup = ["--speedup-from", str(ctx.paths.speedup)] if ctx.paths.speedup.exists() else []
    verifier = ["--verifier", ctx.settings.verifier] if ctx.settings.verifier else []
    for fmt in EXPORT_FORMATS:
        out = ctx.paths.export(fmt)
        _rm(out)  # export writes a new folder
        ctx.run("export", ["export", str(ctx.paths.checkpoint("drafter")), "--format", fmt, "--out", str(out),
                           "--dtype", "bfloat16", *speedup, *verifier, *ctx.target_args()])
        done[fmt] = str(out)
    return done


def report_key(ctx: Context) -> dict[str, Any]:
    """The eval and export records, and the run folder as --out names it: the report's serving lines name
    the exports by that path, so a run folder moved or copied and rerun under its new name rewrites them."""
    return {"eval": ctx.hashes.get("eval"), "export": ctx.hashes.get("export"), "out": str(ctx.paths.root)}


def report_run(ctx: Context, resuming: bool) -> dict[str, Any]:
    return write_report(ctx)
