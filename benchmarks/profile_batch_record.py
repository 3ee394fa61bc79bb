"""One results JSON from what `dev/device_profile_batch.sh` brings back (prof.tgz extracted, summary.log): the
attention-op table, the regeneration profile and every engine profile, with the commit of the tree that ran
(the host's .git may be a stale copy), the note, and the summary log's lines (device, torch, transformers).

Usage: python benchmarks/profile_batch_record.py PROF_DIR SUMMARY.log OUT.json --commit SHA [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def record(prof: Path, summary: Path, commit: str, note: str | None) -> dict:
    """{what, commit, note, summary_log, attention_shapes, regen_profile, engine_profiles: {folder: profile}};
    a step that did not run is absent (None for the two single files). Raises FileNotFoundError for a
    missing PROF_DIR or summary."""
    if not prof.is_dir():
        raise FileNotFoundError(f"{prof}: not a folder (extract prof.tgz there)")
    load = lambda p: json.loads(p.read_text()) if p.is_file() else None  # noqa: E731
    return {"what": "dev/device_profile_batch.sh: attention ops, a regeneration step and engine rounds on random "
                    "weights (SmolLM2-135M shapes, bf16)",
            "commit": commit, "note": note, "summary_log": summary.read_text().splitlines(),
            "attention_shapes": load(prof / "attention-shapes.json"),
            "regen_profile": load(prof / "regen" / "regen-profile.json"),
            "engine_profiles": {p.parent.name: load(p) for p in sorted(prof.glob("engine-*/engine-profile.json"))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prof")
    ap.add_argument("summary")
    ap.add_argument("out")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--note")
    a = ap.parse_args()
    rec = record(Path(a.prof), Path(a.summary), a.commit, a.note)
    Path(a.out).write_text(json.dumps(rec, indent=2) + "\n")
    print(f"wrote {a.out}: {len(rec['engine_profiles'])} engine profiles")


if __name__ == "__main__":
    main()
