"""One results JSON from two `dflash-train regenerate` runs over the same prompts that differ by one flag
(an A/B on one GPU, one after the other in one call): both OUT.report.json files whole, the ratio of
their generated tok/s, and how many records both answered identically (keyed by the first message).

Usage: python benchmarks/regen_ab_record.py A.report.json B.report.json RESULT.json --a-name N --b-name N
         --device TEXT --commit SHA [--command TEXT] [--compare ab-compare.txt] [--note TEXT]
(the two runs' OUT.report.json files; the identical-record count comes from --compare, the device
script's comparison of the two outputs.)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a_report")
    ap.add_argument("b_report")
    ap.add_argument("out")
    ap.add_argument("--a-name", required=True)
    ap.add_argument("--b-name", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command")
    ap.add_argument("--compare", help="the device script's ab-compare.txt (records answered identically)")
    ap.add_argument("--note")
    a_args = ap.parse_args()
    a, b = (json.loads(Path(p).read_text()) for p in (a_args.a_report, a_args.b_report))
    body = {"what": "dflash-train regenerate A/B", "device": a_args.device, "commit_sent": a_args.commit,
            "command": a_args.command, "note": a_args.note,
            "tokens_per_s": {a_args.a_name: a["tokens_per_s"], a_args.b_name: b["tokens_per_s"]},
            f"ratio_{a_args.a_name}_over_{a_args.b_name}": a["tokens_per_s"] / b["tokens_per_s"],
            "reports": {a_args.a_name: a, a_args.b_name: b}}
    if a_args.compare:
        text = Path(a_args.compare).read_text()
        m = re.search(r"(\d+) in both \(same first message\), identical (\d+)", text)
        body["records_in_both"], body["records_identical"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
        body["compare_text"] = text
    Path(a_args.out).write_text(json.dumps(body, indent=2) + "\n")
    print(f"{a_args.a_name} {a['tokens_per_s']:,.0f} tok/s, {a_args.b_name} {b['tokens_per_s']:,.0f} tok/s: "
          f"{body[f'ratio_{a_args.a_name}_over_{a_args.b_name}']:.3f}x")


if __name__ == "__main__":
    main()
