"""The speedup table's choice of draft length (evaluation/draft_length.py), projected from round costs profiled
on random weights (benchmarks/engine_profile.py `round_ms_by_draft_length`) and the conditional acceptance a
trained drafter measured at the same batch size (a recorded eval's `speedup_table`).

A projection, not a measurement: the acceptance of a block of k+1 is taken as the whole block's (the eval's
run at k = B−1), and a replay's time does not depend on the weights but does on the rows' spans (the profile's
prompts, not MT-Bench's). It says which draft lengths a measured table should find worth trying.

Usage: python benchmarks/project_draft_lengths.py EVAL.json OUT.json PROFILE.json [PROFILE.json ...]
  EVAL.json: an eval JSON with `speedup_table`, or a benchmarks/results recipe record (its `speedup`).
  PROFILE.json: engine-profile.json files (their `rows` pick the table's batch size).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_trainer.evaluation.draft_length import best_draft_length, predict_draft_lengths


def project(table: list[dict], profiles: list[dict]) -> list[dict]:
    """One record per profile: batch_size, round_ms (k = 0 … B−1), the acceptance used, per-k predictions,
    the best k and its predicted speedup, beside the eval's own measured full and chosen speedups at that batch
    size. Raises ValueError for a profile whose rows have no table row or whose B differs from the table's."""
    by_b = {row["batch_size"]: row for row in table}
    out = []
    for prof in profiles:
        b = prof["rows"]
        if b not in by_b:
            raise ValueError(f"profile at {b} rows: the eval's table has batch sizes {sorted(by_b)}")
        row, ms = by_b[b], prof["round_ms_by_draft_length"]
        cond = row["conditional_accept_per_position"]
        if len(ms) != len(cond) + 1:
            raise ValueError(f"profile of {len(ms)} draft lengths against a table of B = {len(cond) + 1}")
        pred = predict_draft_lengths(cond, [t / 1e3 for t in ms], b)
        k = best_draft_length(pred)
        out.append({"batch_size": b, "round_ms": ms, "conditional_accept_per_position": cond, "predicted": pred,
                    "best_draft_length": k, "best_predicted_speedup": pred[k]["speedup"],
                    "eval_full_speedup": row.get("speedup"), "eval_chosen_draft_length": row.get("chosen_draft_length"),
                    "eval_chosen_speedup": row.get("chosen_speedup")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("eval_json")
    ap.add_argument("out")
    ap.add_argument("profiles", nargs="+")
    a = ap.parse_args()
    ev = json.loads(Path(a.eval_json).read_text())
    table = (ev.get("speedup") or ev).get("speedup_table")
    if not table:
        raise SystemExit(f"{a.eval_json}: no speedup_table (nor speedup.speedup_table)")
    profiles = [json.loads(Path(p).read_text()) for p in a.profiles]
    rec = {"what": "draft lengths projected from profiled round costs and a recorded eval's acceptance",
           "eval": a.eval_json, "profiles": a.profiles,
           "profile_devices": [p.get("device") for p in profiles], "projection": project(table, profiles)}
    Path(a.out).write_text(json.dumps(rec, indent=2) + "\n")
    for r in rec["projection"]:
        print(f"batch {r['batch_size']}: best k {r['best_draft_length']} projected {r['best_predicted_speedup']:.2f}× "
              f"(the eval measured {r['eval_full_speedup']:.2f}× at all drafts, {r['eval_chosen_speedup']:.2f}× at "
              f"k = {r['eval_chosen_draft_length']})")


if __name__ == "__main__":
    main()
