"""One results JSON from a `dflash-train recipe` run folder (or the small files of one, as a device run packs
them): the plan, the stage records and seconds, τ per suite, the regeneration and mixture reports, the
provenance, every eval JSON whole (per-prompt turns, speeds, lossless check), the speedup table's eval and the
export's speculation sidecar.

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


def _tau_from_evals(evals: dict) -> dict:
    """τ per eval file (`drafter-mt-bench` → {"tau": committed, "tau_uncapped": ...}) for a run stopped before
    its report stage."""
    return {name: {k: e.get(k) for k in ("tau", "tau_uncapped", "offline_tau_exact", "lossless", "num_turns")}
            for name, e in evals.items() if isinstance(e, dict) and "tau" in e}


def record(run: Path, commit: str | None, note: str | None, host_files: list[Path] | None = None) -> dict:
    """The results JSON of a run folder. A run stopped before its report stage (say, by a device budget)
    still gives its stages, evals, τ from the eval files, the regeneration and mixture reports from their
    files and the drafter's provenance; `unfinished` names the stages that have a started record only.
    host_files: logs written on the host (its driver log, a staging call's `nvidia-smi` and version lines),
    kept verbatim: the device and versions of a run stopped before training wrote its provenance."""
    report = _load(run / "report.json") or {}
    stage_files = sorted((run / "stages").glob("*.json"))
    stages = {p.stem: _load(p) for p in stage_files if not p.stem.endswith(".started")}
    unfinished = [p.stem.removesuffix(".started") for p in stage_files if p.stem.endswith(".started")]
    evals = {p.stem: _load(p) for p in sorted((run / "eval").glob("*.json"))}
    summary = _load(run / "drafter" / "summary.json")
    return {
        "what": "dflash-train recipe run",
        "note": note,
        "commit_sent": commit,
        "provenance": report.get("provenance") or _load(run / "drafter" / "provenance.json"),
        "target": report.get("target"),
        "plan": _load(run / "plan.json") or report.get("plan"),
        "stage_seconds": {name: (s or {}).get("seconds") for name, s in stages.items()},
        "unfinished_stages": unfinished,
        "stages": stages,
        "tau": report.get("tau") or _tau_from_evals(evals),
        "train_summary": summary,
        "train_config": _load(run / "drafter" / "train_config.json"),
        "regenerate_report": report.get("regenerate_report") or _load(run / "regen.jsonl.report.json"),
        "mixture_report": report.get("mixture_report") or _load(run / "prompts.jsonl.report.json"),
        "prepare_report": _load(run / "data" / "prepare_report.json"),
        "evals": evals,
        "speedup": _load(run / "speedup" / "drafter-mt-bench.json"),
        "speculation": _load(run / "export-zlab" / "speculation.json"),
        "host_files": {str(p): p.read_text() for p in (host_files or [])},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--commit")
    ap.add_argument("--note")
    ap.add_argument("--host-file", type=Path, action="append", default=[],
                    help="a log written on the host (device, versions), kept verbatim; repeatable")
    a = ap.parse_args()
    body = record(a.run, a.commit, a.note, a.host_file)
    if not body["stages"]:
        raise SystemExit(f"{a.run}: no stages/*.json; pass a recipe run folder")
    a.out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {a.out}: stages {body['stage_seconds']}, τ {body['tau']}")


if __name__ == "__main__":
    main()
