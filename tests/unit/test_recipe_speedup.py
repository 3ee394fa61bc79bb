"""The recipe's speedup table (recipe/stages_late.py): its eval command, the export's --speedup-from, and a
failed table reported and skipped, not fatal (every suite's τ is measured by then)."""

from types import SimpleNamespace

from dflash_trainer.recipe.child import StageFailed
from dflash_trainer.recipe.settings import RecipeSettings, RunPaths
from dflash_trainer.recipe.stages_late import eval_run, eval_settings, export_run, speedup_run


def _ctx(tmp_path, device, fail=False):
    calls, said = [], []

    def run(stage, args):
        calls.append((stage, args))
        if fail and "--batch-sizes" in args:
            raise StageFailed(stage, 1, tmp_path / "no.log")
        if "--json" in args:
            out = args[args.index("--json") + 1]
            open(out, "w").write("{}")

    plan = SimpleNamespace(device=device, eval_max_prompts=1 if device == "cpu" else None, eval_max_new_tokens=64,
                           eval_batch=1 if device == "cpu" else 256, eval_dtype="auto" if device == "cpu" else "float32",
                           heldout_max_prompts=None, heldout_max_turns=None)
    ctx = SimpleNamespace(plan=plan, paths=RunPaths(tmp_path / "run"), settings=RecipeSettings(out=str(tmp_path / "run")),
                          run=run, target_args=lambda: [], say=said.append)
    return ctx, calls, said


def test_gpu_table_is_bf16_at_every_batch_size(tmp_path):
    ctx, calls, _ = _ctx(tmp_path, "cuda")
    s = eval_settings(ctx)
    assert s["speedup"] == {"suite": "mt-bench", "batch_sizes": "1,4,16,64,256", "dtype": "bfloat16"}
    out = speedup_run(ctx, s)
    assert out == str(ctx.paths.speedup)
    args = calls[0][1]
    assert args[args.index("--batch-sizes") + 1] == "1,4,16,64,256" and args[args.index("--dtype") + 1] == "bfloat16"
    assert args[args.index("--max-turns") + 1] == "1" and "--max-prompts" not in args  # MT-Bench whole
    # the exports carry the table
    export_run(ctx, resuming=False)
    assert all(a[a.index("--speedup-from") + 1] == str(ctx.paths.speedup) for _, a in calls[1:]) and len(calls) == 3
    # a table already written is kept (a resumed eval stage)
    assert speedup_run(ctx, s) == out and len(calls) == 3
    # batch sizes up to the plan's eval batch (what fits half the card)
    ctx.plan.eval_batch = 64
    assert eval_settings(ctx)["speedup"]["batch_sizes"] == "1,4,16,64"


def test_a_table_written_later_redoes_the_export(tmp_path):
    """Prevents an export without the table after a failed one was measured again by hand: the export's key
    holds the table's digest."""
    from dflash_trainer.recipe.stages_late import export_key

    ctx, _, _ = _ctx(tmp_path, "cuda")
    ctx.hashes = {"train": "t" * 64}
    without = export_key(ctx)
    ctx.paths.speedup.parent.mkdir(parents=True)
    ctx.paths.speedup.write_text('{"speedup_table": []}')
    assert without["speedup"] is None and export_key(ctx) != without


def test_cpu_table_is_batch_1_in_the_eval_dtype(tmp_path):
    ctx, calls, _ = _ctx(tmp_path, "cpu")
    s = eval_settings(ctx)
    assert s["speedup"] == {"suite": "mt-bench", "batch_sizes": "1", "dtype": "auto"}
    speedup_run(ctx, s)
    args = calls[0][1]
    assert args[args.index("--max-prompts") + 1] == "1"


def test_a_redone_eval_stage_measures_the_table_again(tmp_path):
    """Prevents an earlier drafter's table being kept as this one's when the eval stage is redone (inputs
    changed: a new training); a resumed stage keeps it."""
    ctx, calls, _ = _ctx(tmp_path, "cpu")
    ctx.settings.control = False
    ctx.paths.speedup.parent.mkdir(parents=True)
    ctx.paths.speedup.write_text('{"stale": true}')
    eval_run(ctx, resuming=True)
    assert ctx.paths.speedup.read_text() == '{"stale": true}' and not any("--batch-sizes" in a for _, a in calls)
    eval_run(ctx, resuming=False)
    assert ctx.paths.speedup.read_text() == "{}" and any("--batch-sizes" in a for _, a in calls)


def test_a_failed_table_is_reported_and_the_export_goes_without_it(tmp_path):
    ctx, calls, said = _ctx(tmp_path, "cuda", fail=True)
    out = speedup_run(ctx, eval_settings(ctx))
    assert out.startswith("failed: stage eval exited with 1") and not ctx.paths.speedup.exists()
    assert said and "speedup table failed" in said[0]
    export_run(ctx, resuming=False)
    assert all("--speedup-from" not in a for _, a in calls[1:])


def test_the_recipe_ends_by_saying_tau_the_speedup_to_serve_and_how_to_serve():
    """The console summary from report.json: τ per run and suite, the smallest and largest batch's recommended
    draft length and speedup (with all drafts beside it), the first serving line; nothing for what is missing."""
    from dflash_trainer.recipe.report import console_summary

    report = {"tau": {"drafter": {"mt-bench": {"tau": 3.417}, "humaneval": {"tau": 3.571}},
                      "control": {"mt-bench": {"tau": 1.31}}},
              "speedup_table": [
                  {"batch_size": 1, "recommended_draft_length": 15, "recommended_speedup": 2.31, "full_draft_length": 15,
                   "speedup": 2.31},
                  {"batch_size": 16, "recommended_draft_length": 7, "recommended_speedup": 1.4, "full_draft_length": 15,
                   "speedup": 1.2},
                  {"batch_size": 256, "recommended_draft_length": 0, "recommended_speedup": 1.0, "full_draft_length": 15,
                   "speedup": 0.6}],
              "serve": ["vllm serve org/t --speculative-config '{...}'", "python -m sglang.launch_server ..."]}
    assert console_summary(report) == [
        "τ (T = 0), drafter: mt-bench 3.42 · humaneval 3.57",
        "τ (T = 0), control: mt-bench 1.31",
        "speedup at batch 1: 2.31× with 15 drafts a round (all 15 drafts: 2.31×)",
        "speedup at batch 256: plain decoding is fastest (all 15 drafts: 0.60×)",
        "serve: vllm serve org/t --speculative-config '{...}'"]
    assert console_summary({"tau": {}}) == []
    # rows in another order (a table written by hand) and a row of an older eval without a recommendation
    report["speedup_table"] = [report["speedup_table"][2], {"batch_size": 1, "speedup": 2.0}, report["speedup_table"][1]]
    assert console_summary(report)[2:4] == ["speedup at batch 1: 2.00×",
                                            "speedup at batch 256: plain decoding is fastest (all 15 drafts: 0.60×)"]
    # plain decoding fastest at the smallest batch: said under the serving line, which verifies every draft
    report["speedup_table"] = [{**report["speedup_table"][0], "batch_size": 1}]
    assert console_summary(report)[-2:] == [
        "serve: vllm serve org/t --speculative-config '{...}'",
        "These lines verify every draft a round. At batch 1 the measured table says plain decoding was faster "
        "(leave speculation off); the exports' speculation.json gives the draft length for each batch size."]
