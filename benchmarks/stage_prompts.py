"""Write the first N usable conversations of a chat file with every assistant turn emptied to ".".

For carrying ShareGPT's prompts to a machine without the 125 MB file: `dflash-train regenerate`
replaces every assistant turn anyway, so regenerating this file gives the same output as
regenerating the original. With --keep-answers the same N conversations are written unchanged
(the original answers, for the recipe's original-data variant).
Usage: python benchmarks/stage_prompts.py OUT.jsonl N [CHAT_FILE] [--keep-answers]
"""

from __future__ import annotations

import copy
import json
import sys

from dflash_trainer.data.chat import ROLE_MAP, ReadStats, iter_records, normalize_record
from dflash_trainer.data.sources import default_sharegpt_path


def main() -> None:
    keep = "--keep-answers" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--keep-answers"]
    out, n = args[0], int(args[1])
    src = args[2] if len(args) > 2 else default_sharegpt_path()
    kept = 0
    with open(out, "w", encoding="utf-8") as f:
        for _, record in iter_records(src, ReadStats()):
            try:
                normalize_record(record)
            except Exception:  # unusable records are skipped by regenerate too
                continue
            rec = copy.deepcopy(record)
            for turn in [] if keep else rec.get("conversations", rec.get("messages", [])):
                if ROLE_MAP.get(str(turn.get("from", turn.get("role"))).lower()) == "assistant":
                    turn["value" if "value" in turn else "content"] = "."
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            kept += 1
            if kept >= n:
                break
    print(f"{kept} conversations -> {out}")


if __name__ == "__main__":
    main()
