"""One results JSON from a `dflash-train recipe` run folder (or the small files of one, as a device run packs
them): the plan, the stage records and seconds, τ per suite, the regeneration and mixture reports, the
provenance, and every eval JSON whole (per-prompt turns, speeds, lossless check).

The run's own provenance names the git SHA of the checkout it ran from; `--commit` records the commit of
the tree that was actually sent when that checkout's .git was a stale copy (provenance `git_dirty` true).
Usage: python benchmarks/recipe_run_record.py RUN OUT.json [--commit SHA] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def record(run: Path, commit: str | None, note: str | None) -> dict:
    report = _load(run / "report.json") or {}
    stages = {p.stem: _load(p) for p in sorted((run / "stages").glob("*.json")) if not p.stem.endswith(".started")}
    evals = {p.stem: _load(p) for p in sorted((run / "eval").glob("*.json"))}
    summary = _load(run / "drafter" / "summary.json")
    return {
        "what": "dflash-train recipe run",
        "note": note,
        "commit_sent": commit,
        "provenance": report.get("provenance"),
        "target": report.get("target"),
        "plan": _load(run / "plan.json") or report.get("plan"),
        "stage_seconds": {name: (s or {}).get("seconds") for name, s in stages.items()},
        "stages": stages,
        "tau": report.get("tau"),
        "train_summary": summary,
        "regenerate_report": report.get("regenerate_report"),
        "mixture_report": report.get("mixture_report"),
        "evals": evals,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--commit")
    ap.add_argument("--note")
    a = ap.parse_args()
    body = record(a.run, a.commit, a.note)
    if not body["stages"]:
        raise SystemExit(f"{a.run}: no stages/*.json; pass a recipe run folder")
    a.out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {a.out}: stages {body['stage_seconds']}, τ {body['tau']}")


if __name__ == "__main__":
    main()
