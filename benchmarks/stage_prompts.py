"""Write the first N usable conversations of a chat file with every assistant turn emptied to ".".

For carrying ShareGPT's prompts to a machine without the 125 MB file: `dflash-train regenerate`
replaces every assistant turn anyway, so regenerating this file gives the same output as
regenerating the original. Usage: python benchmarks/stage_prompts.py OUT.jsonl N [CHAT_FILE]
"""

from __future__ import annotations

import copy
import json
import sys

from dflash_trainer.data.chat import ROLE_MAP, ReadStats, iter_records, normalize_record
from dflash_trainer.data.sources import default_sharegpt_path


def main() -> None:
    out, n = sys.argv[1], int(sys.argv[2])
    src = sys.argv[3] if len(sys.argv) > 3 else default_sharegpt_path()
    kept = 0
    with open(out, "w", encoding="utf-8") as f:
        for _, record in iter_records(src, ReadStats()):
            try:
                normalize_record(record)
            except Exception:  # unusable records are skipped by regenerate too
                continue
            rec = copy.deepcopy(record)
            for turn in rec.get("conversations", rec.get("messages", [])):
                if ROLE_MAP.get(str(turn.get("from", turn.get("role"))).lower()) == "assistant":
                    turn["value" if "value" in turn else "content"] = "."
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            kept += 1
            if kept >= n:
                break
    print(f"{kept} conversations -> {out}")


if __name__ == "__main__":
    main()
