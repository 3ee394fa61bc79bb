"""Write the first N usable conversations of a chat file with every assistant turn emptied to ".".

For carrying ShareGPT's prompts to a machine without the 125 MB file: `dflash-train regenerate`
replaces every assistant turn anyway, so regenerating this file gives the same output as
regenerating the original. With --keep-answers the same N conversations are written unchanged
(the original answers, for the recipe's original-data variant). With --heldout the first N
conversations of the embedded ShareGPT's held-out tail are written instead (the `sharegpt-heldout`
suite, for measured τ during training on a machine without the 125 MB file).
Usage: python dev/stage_prompts.py OUT.jsonl N [CHAT_FILE] [--keep-answers | --heldout]
"""

from __future__ import annotations

import copy
import json
import sys

from dflash_trainer.data.chat import ROLE_MAP, ReadStats, iter_records, normalize_record
from dflash_trainer.data.sources import default_sharegpt_path, sharegpt_heldout_start


def main() -> None:
    keep = "--keep-answers" in sys.argv
    args = [a for a in sys.argv[1:] if a not in ("--keep-answers", "--heldout")]
    out, n = args[0], int(args[1])
    src = args[2] if len(args) > 2 else default_sharegpt_path()
    kept = 0
    skip = sharegpt_heldout_start() if "--heldout" in sys.argv else 0  # usable conversations before the tail
    with open(out, "w", encoding="utf-8") as f:
        for _, record in iter_records(src, ReadStats()):
            try:
                normalize_record(record)
            except Exception:  # unusable records are skipped by regenerate too
                continue
            if skip:
                skip -= 1
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
