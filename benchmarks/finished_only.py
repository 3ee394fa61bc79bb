"""Keep only the answers the target finished: cut each regenerated conversation before its first
assistant turn marked `"truncated": true` (cut by `max_new_tokens`; small targets often run into
repetition there); a conversation left without an assistant turn after a user turn is dropped.

The recipe's `finished` variant trains on this file to separate "regenerated data" from "data full of
unfinished, often looping answers". Reads a JSON array or JSONL, writes JSONL.
Usage: python benchmarks/finished_only.py REGEN.jsonl OUT.jsonl  (counts also in OUT.jsonl.counts.json)
"""

from __future__ import annotations

import json
import sys

from dflash_trainer.data.chat import ReadStats, RecordSkipped, iter_records, normalize_record


def finished_only(record: dict) -> dict | None:
    """The record cut before its first truncated turn, or None when what is left is not a usable
    conversation (the trainer's own rule, `data/chat.normalize_record`: e.g. no answer after a user turn)."""
    key = "conversations" if "conversations" in record else "messages"
    turns = record[key]
    cut = next((i for i, t in enumerate(turns) if t.get("truncated")), len(turns))
    out = {**record, key: turns[:cut]}
    try:
        normalize_record(out)
    except RecordSkipped:
        return None
    return out


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    read = written = cut = 0
    stats = ReadStats()
    with open(dst, "w", encoding="utf-8") as fout:
        for _, rec in iter_records(src, stats):  # the trainer's reader: JSON array or JSONL
            read += 1
            out = finished_only(rec) if isinstance(rec, dict) and ("conversations" in rec or "messages" in rec) else None
            if out is None:
                continue
            key = "conversations" if "conversations" in rec else "messages"
            cut += len(out[key]) < len(rec[key])
            fout.write(json.dumps(out, ensure_ascii=False) + "\n")
            written += 1
    counts = json.dumps({"read": read, "written": written, "cut": cut, "dropped": read - written,
                         "unreadable": dict(stats.skipped)})
    with open(dst + ".counts.json", "w", encoding="utf-8") as f:
        f.write(counts + "\n")
    print(counts)


if __name__ == "__main__":
    main()
