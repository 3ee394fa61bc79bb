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

from dflash_trainer.data.chat import ROLE_MAP


def finished_only(record: dict) -> dict | None:
    """The record cut before its first truncated turn, or None when no answered turn is left."""
    key = "conversations" if "conversations" in record else "messages"
    turns = record[key]
    cut = next((i for i, t in enumerate(turns) if t.get("truncated")), len(turns))
    kept = turns[:cut]
    roles = [ROLE_MAP.get(str(t.get("from", t.get("role"))).lower()) for t in kept]
    first_user = roles.index("user") if "user" in roles else len(roles)
    if "assistant" not in roles[first_user:]:  # an assistant turn before any user turn answers nothing
        return None
    return {**record, key: kept}


def _records(path: str):
    """The records of a JSON-array file (what regenerate writes for a JSON input) or a JSONL file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip()[:1] == "[":
        yield from json.loads(text)
    else:
        yield from (json.loads(line) for line in text.split("\n") if line.strip())  # not splitlines(): U+2028 etc. occur inside strings


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    read = written = cut = 0
    with open(dst, "w", encoding="utf-8") as fout:
        for rec in _records(src):
            read += 1
            out = finished_only(rec)
            if out is None:
                continue
            key = "conversations" if "conversations" in rec else "messages"
            cut += len(out[key]) < len(rec[key])
            fout.write(json.dumps(out, ensure_ascii=False) + "\n")
            written += 1
    counts = json.dumps({"read": read, "written": written, "cut": cut, "dropped": read - written})
    with open(dst + ".counts.json", "w", encoding="utf-8") as f:
        f.write(counts + "\n")
    print(counts)


if __name__ == "__main__":
    main()
