"""The recipe's report: RUN/report.json (plan, stage records, τ per run and suite, the speedup table),
RUN/report.png (τ per suite, drafter beside control) and RUN/REPORT.md (the τ table; τ by turn, by how the
turn ended and by MT-Bench category; the speedup by batch size with the draft length to serve; and the
serving lines of README's "Export and serve")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dflash_trainer.decoding.committed import breakdown_line
from dflash_trainer.recipe.records import write_json_atomic
from dflash_trainer.recipe.settings import SUITES

if TYPE_CHECKING:
    from dflash_trainer.recipe.stages import Context


def _eval_results(ctx: "Context") -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted(ctx.paths.eval.glob("*.json")):
        run, _, suite = path.stem.partition("-")
        r = json.loads(path.read_text())
        out.setdefault(run, {})[suite] = {k: r.get(k) for k in ("tau", "offline_tau_exact", "lossless", "speedup",
                                                                "num_prompts", "num_turns", "skipped_turns", "tokens",
                                                                "tau_breakdown")}
    return out


def _read(path: Path) -> Optional[dict[str, Any]]:
    """A JSON record the report carries whole (the training's provenance: commit, devices, versions; the
    mixture's and the regeneration's reports), or None when that stage did not write it."""
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def serve_target(ctx: "Context") -> str:
    """The model the serving lines load as the target: --verifier when given, else the hub id the
    speculators export records as its verifier (HuggingFaceTB/SmolLM2-135M-Instruct for the embedded target,
    never the tool's own name for it), else the named target's hub id, else --target as given (a local folder
    or file serves as it is; the export records only its name)."""
    from dflash_trainer.interop.verifier import known_target_facts, looks_like_hub_id

    if ctx.settings.verifier:
        return ctx.settings.verifier
    cfg = ctx.paths.export("speculators") / "config.json"
    if cfg.exists():
        verifier = (json.loads(cfg.read_text()).get("speculators_config") or {}).get("verifier") or {}
        if looks_like_hub_id(verifier.get("name_or_path")):
            return str(verifier["name_or_path"])
    facts = known_target_facts(ctx.settings.target)
    return (facts.hub_id if facts and facts.hub_id else None) or str(ctx.settings.target)


def serving_lines(ctx: "Context") -> list[str]:
    """The vLLM / SGLang lines for the exports, num_speculative_tokens = B − 1 (B from the export's config)."""
    b = 8
    cfg = ctx.paths.export("zlab") / "config.json"
    if cfg.exists():
        body = json.loads(cfg.read_text())
        b = int(body.get("block_size") or body.get("dflash_config", {}).get("block_size") or b)
    target = serve_target(ctx)
    z, s = ctx.paths.export("zlab"), ctx.paths.export("speculators")
    return [f"vllm serve {target} --speculative-config '{{\"method\": \"dflash\", \"model\": \"{z}\", "
            f"\"num_speculative_tokens\": {b - 1}}}'",
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {z} --trust-remote-code",
            f"vllm serve {target} --speculative-config '{{\"method\": \"dflash\", \"model\": \"{s}\", "
            f"\"num_speculative_tokens\": {b - 1}}}'"]


def _png(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(1, len(results))
    for i, (run, by_suite) in enumerate(results.items()):
        taus = [by_suite.get(s, {}).get("tau") or 0 for s in SUITES]
        ax.bar([j + i * width for j in range(len(SUITES))], taus, width, label=run)
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(SUITES))], SUITES)
    ax.set_ylabel("measured τ (tokens / round)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def speedup_lines(speedup: Optional[dict[str, Any]]) -> list[str]:
    """REPORT.md's speedup section from the speedup eval's JSON (its `speedup_table`, evaluation/speedup.py):
    per batch size the speedup with every draft verified, the recommended draft length k (0 = plain decoding)
    and its speedup."""
    table = (speedup or {}).get("speedup_table")
    if not table:
        return []
    lines = ["", f"## Speedup by batch size ({speedup.get('dataset')} first turns, target {speedup.get('target_dtype')})",
             "",
             "| batch | speedup, all drafts | draft length to serve | its speedup |", "|---|---|---|---|"]
    for row in table:
        lines.append(f"| {row.get('batch_size')} | {_fmt(row.get('speedup'))}× | {row.get('recommended_draft_length')} "
                     f"| {_fmt(row.get('recommended_speedup'))}× |")
    return lines + ["", "The exports' speculation.json holds this table (docs/formats.md)."]


def serve_note(speedup: Optional[dict[str, Any]]) -> list[str]:
    """A line under the serving lines when the measured table recommends fewer drafts than they verify at its
    smallest batch (0: plain decoding is faster there), so the lines are not read as the advice."""
    table = (speedup or {}).get("speedup_table") or []
    if not table:
        return []
    row = min(table, key=lambda r: r.get("batch_size") or 0)
    k, most = row.get("recommended_draft_length"), row.get("full_draft_length")
    if k is None or (most is not None and k >= most):
        return []
    what = ("plain decoding was faster (leave speculation off)" if k == 0 else
            f"set num_speculative_tokens to {k} ({_fmt(row.get('recommended_speedup'))}×)")
    return ["", f"These lines verify every draft a round. At batch {row.get('batch_size')} the measured table says "
                f"{what}; the exports' speculation.json gives the draft length for each batch size."]


def console_summary(report: dict[str, Any]) -> list[str]:
    """What the recipe says when it ends, from RUN/report.json: measured τ per run and suite, the speedup and
    draft length to serve at the table's smallest and largest batch, the first serving line and, when the
    table advises fewer drafts than it verifies at the smallest batch, that advice (`serve_note`)."""
    lines = []
    for run, by_suite in (report.get("tau") or {}).items():
        taus = " · ".join(f"{s} {_fmt((by_suite.get(s) or {}).get('tau'))}" for s in SUITES if s in by_suite)
        lines.append(f"τ (T = 0), {run}: {taus}")
    table = [r for r in report.get("speedup_table") or [] if r.get("batch_size") is not None]
    table.sort(key=lambda r: r["batch_size"])
    for row in table[:1] + table[1:][-1:]:  # the smallest batch and the largest
        k, full = row.get("recommended_draft_length"), row.get("full_draft_length")
        best = ("plain decoding is fastest" if k == 0 else
                f"{_fmt(row.get('recommended_speedup'))}× with {k} drafts a round" if k is not None else
                f"{_fmt(row.get('speedup'))}×")
        lines.append(f"speedup at batch {row['batch_size']}: {best}" +
                     (f" (all {full} drafts: {_fmt(row.get('speedup'))}×)" if k is not None else ""))
    serve = report.get("serve") or []
    note = [line for line in serve_note({"speedup_table": table}) if line]
    return lines + ([f"serve: {serve[0]}", *note] if serve else [])


def _provenance_line(prov: Optional[dict[str, Any]]) -> list[str]:
    if not prov:
        return []
    v = prov.get("versions") or {}
    commit = (prov.get("git_sha") or "unknown") + (" with tracked files changed" if prov.get("git_dirty") else "")
    return ["", f"Trained on {', '.join(prov.get('cuda_devices') or []) or 'CPU'}; commit {commit}; "
                f"torch {v.get('torch')}, transformers {v.get('transformers')}."]


def write_report(ctx: "Context") -> dict[str, Any]:
    """Write RUN/report.json, RUN/report.png and RUN/REPORT.md from the eval JSONs and the stage records;
    returns the paths written."""
    from dflash_trainer.recipe.records import StageRecords

    results = _eval_results(ctx)
    speedup = _read(ctx.paths.speedup)
    records = StageRecords(ctx.paths.root)
    stages = {s: records.finished(s) for s in ctx.settings.stages() if s != "report"}
    body = {"target": ctx.settings.target or "embedded smollm2-135m", "plan": ctx.plan.as_dict(), "tau": results,
            "stages": {s: r and {"seconds": r.get("seconds"), "hash": r.get("hash"), "outputs": r.get("outputs")}
                       for s, r in stages.items()},
            "provenance": _read(ctx.paths.run_dir("drafter") / "provenance.json"),
            "mixture_report": _read(ctx.paths.prompts.with_name(ctx.paths.prompts.name + ".report.json")),
            "regenerate_report": _read(ctx.paths.regen.with_name(ctx.paths.regen.name + ".report.json")),
            "speedup_table": (speedup or {}).get("speedup_table"),
            "serve": serving_lines(ctx) if "export" in stages else []}
    root = ctx.paths.root
    write_json_atomic(root / "report.json", body)
    if results:
        _png(results, root / "report.png")
    lines = [f"# Recipe report: {body['target']}", "",
             f"Plan: {ctx.plan.device}" + (f", {ctx.plan.gpu_memory_gib:g} GiB" if ctx.plan.gpu_memory_gib else "")
             + f", {ctx.plan.steps} steps of {ctx.plan.rows_per_step} row{'s' if ctx.plan.rows_per_step != 1 else ''} × "
             f"{ctx.plan.seq_len} tokens, feature cache {ctx.plan.feature_cache_gib:g} GiB.",
             *([f"\n**{ctx.plan.reasons['device']}**: it shows the whole path on this machine; on a GPU host the same "
                "command plans the real run."] if ctx.plan.device == "cpu" else []),
             *_provenance_line(body["provenance"]), "", "## Measured τ (T = 0)", "",
             "| run | " + " | ".join(SUITES) + " |", "|---" * (len(SUITES) + 1) + "|"]
    for run, by_suite in results.items():
        lines.append(f"| {run} | " + " | ".join(
            f"{_fmt(by_suite.get(s, {}).get('tau'))}" + ("" if by_suite.get(s, {}).get("lossless") in (True, None)
                                                         else " (not lossless)") for s in SUITES) + " |")
    breakdowns = [f"- {run}, {s}: {line}" for run, by_suite in results.items() for s, r in by_suite.items()
                  if (line := breakdown_line(r.get("tau_breakdown") or {}))]
    if breakdowns:
        lines += ["", "τ by turn, by how the turn ended (eos or the token cap) and by MT-Bench category:", "",
                  *breakdowns]
    lines += speedup_lines(speedup)
    lines += ["", "## Stages", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {s} | {'-' if not r else round(r.get('seconds') or 0)} |" for s, r in stages.items()]
    if "export" in stages:
        lines += ["", "## Serve", "", "```bash", *serving_lines(ctx), "```", "",
                  "SGLang serves the zlab folder only (README, \"Export and serve\").", *serve_note(speedup)]
    (root / "REPORT.md").write_text("\n".join(lines) + "\n")
    return {"report_json": str(root / "report.json"), "report_md": str(root / "REPORT.md"),
            "png": str(root / "report.png") if results else None}
