"""Summarize a recipe run (dev/recipe_smollm2.sh, dev/prepared_runs.sh) into one results JSON and one PNG.

Reads WORK/{regen.jsonl.report.json, data*/prepare_report.json, stages.txt,
RUN/{metrics.jsonl,summary.json}, eval-RUN-{mt-bench,humaneval}.json} for each RUN (default: drafter,
control; the ablation adds finished, original). Writes RESULTS/recipe-smollm2_<gpu>_<date>.json and
.png (recipe-smollm2-ablation_… for other runs than drafter + control): τ per dataset and run, per-position conditional acceptance, learning curves (train loss, τ
estimate). Ratios are each run's τ over the control's. --model names another target (a packaged
target's name, e.g. qwen2.5-coder-0.5b: recipe-qwen2.5-coder-0.5b_<gpu>_<date>.json).
Usage: python benchmarks/recipe_report.py WORK [--results benchmarks/results] [--runs drafter control ...] [--model NAME]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

RUNS = ("drafter", "control")
MODELS = {"smollm2": "SmolLM2-135M-Instruct", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct (GGUF)",
          "gemma3-270m": "Gemma 3 270M, pretrained (GGUF)"}  # --model → the title's words
DATA_OF = {"finished": "data-finished", "original": "data-original", "no-code": "data-no-code"}  # others: WORK/data
COLORS = {"drafter": "tab:blue", "control": "tab:gray", "finished": "tab:green", "original": "tab:orange"}
DATA_NAMES = {"data": "regenerated ShareGPT", "data-original": "original ShareGPT answers",
              "data-finished": "regenerated ShareGPT cut before unfinished answers",
              "data-no-code": "the same regenerated data without its code prompts"}
DATASETS = ("mt-bench", "humaneval")
MIN_ROUNDS = 50  # a conditional acceptance drawn from fewer rounds is not plotted (noise)


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().split("\n") if ln.strip()] if path.is_file() else []


def _metrics(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in _lines(path)]


def _tau_first(ev: dict | None, n: int) -> float | None:
    """Committed τ (the eval's `tau`: each turn's new tokens less the prefill's, over rounds;
    decoding/committed.py) of the first n prompts of an eval's per-prompt records, None without them."""
    from dflash_trainer.decoding.committed import tau_of_turns

    return tau_of_turns(t for p in ((ev or {}).get("per_prompt") or [])[:n] for t in p.get("turns", []))


def _stages(path: Path) -> dict[str, float]:
    """Seconds spent in each stage, from the `name epoch_seconds` lines the script writes."""
    if not path.is_file():
        return {}
    marks = [(ln.split()[0], float(ln.split()[1])) for ln in path.read_text().splitlines() if ln.strip()]
    return {name: round(t - marks[i - 1][1], 1) for i, (name, t) in enumerate(marks) if i}


def main() -> None:
    """Read the recipe folder, write the results JSON and PNG (module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--results", default="benchmarks/results")
    ap.add_argument("--gpu", default="h200", help="hardware tag of the file name")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), help="run folders under WORK (control = the baseline)")
    ap.add_argument("--tag", default="", help="suffix of an ablation's file names (recipe-smollm2-ablation-TAG_…)")
    ap.add_argument("--model", default="smollm2", help="the target, in the file names and the title")
    args = ap.parse_args()
    work, results, runs = Path(args.work), Path(args.results), args.runs
    # WORK/runs.jsonl (written by recipe_smollm2.sh / prepared_runs.sh): each run's data folder and changed settings
    settings = {r["run"]: r for r in map(json.loads, _lines(work / "runs.jsonl"))}
    data_of = {r: settings.get(r, {}).get("data") or DATA_OF.get(r, "data") for r in runs}
    evals = {(r, d): _load(work / f"eval-{r}-{d}.json") for r in runs for d in DATASETS}
    tau = {r: {d: (evals[r, d] or {}).get("tau") for d in DATASETS} for r in runs}
    base = tau.get("control", {})
    prepares = {r: _load(work / data_of[r] / "prepare_report.json") for r in runs}
    names = dict(DATA_NAMES)
    sources = sorted(k for k in ((_load(work / "regen.jsonl.report.json") or {}).get("by_source") or {})
                     if k not in ("None", "(none)"))
    if sources:  # a regenerated prompt mixture (data/mixture), not ShareGPT alone
        names["data"] = f"the target's own answers to the prompt mixture ({', '.join(sources)})"
    out = {
        "what": f"{MODELS.get(args.model, args.model)} DFlash drafter vs no-target-features control, trained on "
                + " + ".join(sorted({names.get(data_of[r], data_of[r]) for r in runs}))
                + (f" (runs: {', '.join(runs)})" if list(runs) != list(RUNS) else ""),
        "date": dt.date.today().isoformat(),
        "stages_s": _stages(work / "stages.txt"),
        "regenerate": _load(work / "regen.jsonl.report.json"),
        # REGEN_CONTINUE: each continuation alone (regenerate: the merged report of the whole)
        "regenerate_continued": [r for p in sorted(work.glob("regen-more-*.jsonl.report.json")) if (r := _load(p))],
        "finished_only": _load(work / "regen-finished.jsonl.counts.json"),
        "runs": {r: {"data": data_of[r], "sets": settings.get(r, {}).get("sets", "")} for r in runs},
        "prepare": {data_of[r]: p for r, p in prepares.items()},
        "train": {r: _load(work / r / "summary.json") for r in runs},
        "tau": tau,
        # τ over the first 64 prompts of each suite: the slice the 2026-12-01 long runs were evaluated on
        "tau_first_64_prompts": {r: {d: _tau_first(evals[r, d], 64) for d in DATASETS} for r in runs},
        "tau_ratio_over_control": {r: {d: (tau[r][d] / base[d] if tau[r][d] and base.get(d) else None)
                                       for d in DATASETS} for r in runs if r != "control"},
        "eval": {f"{r}/{d}": ({k: e.get(k) for k in ("tau", "lossless", "rounds", "tokens", "num_prompts", "num_turns",
                                                       "accept_histogram", "conditional_accept_per_position",
                                                       "target_tokens_per_s", "speculative_tokens_per_s", "speedup",
                                                       "plain_wall_s", "speculative_wall_s", "batch_size",
                                                       "offline_tau_exact", "offline_tau_estimate",
                                                       "offline_acc_per_position")}
                              if e else None) for (r, d), e in evals.items()},
    }
    # measured τ during training (tau_every) per run: [[step, τ], ...]
    out["tau_measured_curve"] = {r: [[m["step"], m["tau_measured"]] for m in _metrics(work / r / "metrics.jsonl")
                                     if m.get("tau_measured") is not None] for r in runs}
    # DIAG_EVALS: the first run on other prompt sets (e.g. each mixture source), measured and offline τ
    out["diagnostic_evals"] = {p.stem.split("-diag-", 1)[1]: {k: e.get(k) for k in (
        "tau", "offline_tau_exact", "offline_tau_estimate", "lossless", "num_prompts", "tokens", "rounds",
        "conditional_accept_per_position")} for p in sorted(work.glob("eval-*-diag-*.json"))
        if (e := _load(p))}
    if out["regenerate"]:
        out["regenerate"].pop("examples", None)
    out["prepare"] = {name: {k: v for k, v in p.items() if not isinstance(v, (list, dict)) or k.startswith("skip")}
                      for name, p in out["prepare"].items() if p}
    kind = f"recipe-{args.model}" + ("" if list(runs) == list(RUNS) else "-ablation")  # a same-day ablation keeps the recipe's files
    kind += f"-{args.tag}" if args.tag else ""
    stem = results / f"{kind}_{args.gpu}_{out['date']}"
    results.mkdir(parents=True, exist_ok=True)
    # names are appended to, not given with Path.with_suffix: a model name with a dot (qwen2.5-…) has a "suffix"
    Path(f"{stem}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    _plot(out, {r: _metrics(work / r / "metrics.jsonl") for r in runs}, Path(f"{stem}.png"))
    print(json.dumps({"tau": tau, "ratio": out["tau_ratio_over_control"], "stages_s": out["stages_s"]}))
    print(f"wrote {stem}.json and .png")


def _plot(out: dict, metrics: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(18, 8))
    runs = list(metrics)
    colors = {r: COLORS.get(r, f"C{i}") for i, r in enumerate(runs)}
    width = 0.8 / len(runs)
    a = ax[0][0]  # τ per dataset
    for i, r in enumerate(runs):
        vals = [out["tau"][r][d] or 0 for d in DATASETS]
        bars = a.bar([x + width * i for x in range(len(DATASETS))], vals, width * 0.95, label=r, color=colors[r])
        a.bar_label(bars, fmt="%.2f", fontsize=8)
    a.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(DATASETS))], DATASETS)
    a.set_ylabel("τ (tokens per round, T=0)")
    a.set_title("measured acceptance length")
    a.legend()
    a = ax[0][1]  # per-position conditional acceptance
    for r in runs:
        for d, style in zip(DATASETS, ("-", "--")):
            e = out["eval"].get(f"{r}/{d}")
            if e and e["conditional_accept_per_position"]:
                hist = e["accept_histogram"]
                reached = [sum(hist[k:]) for k in range(len(hist))]  # rounds that got to draft k+1
                ys = [y if y is not None and reached[k] >= MIN_ROUNDS else float("nan")
                      for k, y in enumerate(e["conditional_accept_per_position"])]
                a.plot(range(1, len(ys) + 1), ys, style, color=colors[r], marker=".", label=f"{r} {d}")
    a.set_xlabel("draft position k")
    a.set_ylabel(f"P(accept k | accepted < k), ≥ {MIN_ROUNDS} rounds")
    a.set_ylim(0, 1)
    a.set_title("per-position acceptance")
    a.legend(fontsize=8)
    for a, key, title in ((ax[1][0], "loss", "train loss"), (ax[1][1], "tau_estimate", "train τ estimate")):
        for r in runs:
            pts = [(m["step"], m[key]) for m in metrics[r] if m.get(key) is not None]
            if pts:
                a.plot(*zip(*pts), color=colors[r], label=r)
            measured = out["tau_measured_curve"].get(r) if key == "tau_estimate" else None
            if measured:
                a.plot(*zip(*measured), "--", marker="o", color=colors[r], label=f"{r} measured τ (held-out)")
        a.set_xlabel("step")
        a.set_title(title)
        a.legend()
    a = ax[0][2]  # validation accuracy per slot at the end of training
    for r in runs:
        acc = ((out["train"].get(r) or {}).get("validation") or {}).get("acc_per_position")
        if acc:
            a.plot(range(1, len(acc) + 1), acc, color=colors[r], marker=".", label=r)
    a.set_xlabel("block slot k")
    a.set_ylabel("validation accuracy")
    a.set_ylim(0, 1)
    a.set_title("per-slot accuracy on held-out rows (end of training)")
    a.legend(fontsize=8)
    a = ax[1][2]  # training accuracy of slots 1, 4 and 15 over time
    for r in runs:
        for k, style in ((0, "-"), (3, "--"), (14, ":")):
            pts = [(m["step"], m["acc_per_position"][k]) for m in metrics[r]
                   if m.get("acc_per_position") and len(m["acc_per_position"]) > k and m["acc_per_position"][k] is not None]
            if pts:
                a.plot(*zip(*pts), style, color=colors[r], label=f"{r} k={k + 1}")
    a.set_xlabel("step")
    a.set_title("train accuracy of slots 1 (solid), 4 (dashed), 15 (dotted)")
    a.legend(fontsize=6, ncol=2)
    fig.suptitle(out["what"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
