"""Read chat files and normalize every record to a list of `{"role", "content"}` messages.

Files: a JSON array (possibly truncated: the embedded ShareGPT file ends mid-record, so the array
is parsed element by element and the unparseable tail is counted), or JSONL (one record a line).

Records, either of
  ShareGPT: {"id": ..., "conversations": [{"from": "human|gpt|system|...", "value": "..."}]}
  OpenAI:   {"messages": [{"role": "system|user|assistant", "content": "..."}]}
(the turn keys `from`/`value` and `role`/`content` are accepted in either list).

Normalized roles are `system`, `user`, `assistant`. A record that cannot be used is skipped and
counted by reason in `ReadStats` (with the first few record indices as examples); nothing is
dropped silently and nothing raises. Two repairs are made and counted instead of skipping:
assistant turns before the first user turn are dropped (ShareGPT has records that start with
`gpt`), and turns after the last assistant turn are dropped (they carry no supervised token).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLE_MAP: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}

NUM_EXAMPLES = 5  # record references kept per skip reason
# What a skip reason asks of the record (the format above), for the lines that report skips
SKIP_HINTS: dict[str, str] = {
    "invalid_json": "each line must be one JSON object",
    "not_an_object": "each record must be a JSON object",
    "missing_conversations": "a record needs a 'conversations' list (ShareGPT) or a 'messages' list (OpenAI)",
    "conversations_not_a_list": "'conversations' / 'messages' must be a list of turns",
    "empty_conversation": "'conversations' / 'messages' holds no turn",
    "turn_not_an_object": "each turn must be a JSON object",
    "turn_missing_keys": "each turn needs 'from' and 'value' (ShareGPT) or 'role' and 'content' (OpenAI)",
    "unknown_role": f"roles are {', '.join(ROLE_MAP)}",
    "non_string_content": "a turn's text must be a string",
    "empty_turn": "a turn's text is empty",
    "no_user_turn": "a conversation needs a user turn",
    "no_assistant_turn": "a conversation needs an assistant turn after a user turn",
    "truncated_tail": "the file ends inside a record: an interrupted download or write?",
}


def skip_summary(skipped: dict[str, int], examples: dict[str, list[str]] | None = None) -> str:
    """'reason N (what it asks; e.g. line 4, line 9), ...' for skip counts by reason, most common first;
    `examples`: record references per reason (as ReadStats keeps them)."""
    parts = []
    for reason, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])):
        notes = [SKIP_HINTS[reason]] if reason in SKIP_HINTS else []
        if examples and examples.get(reason):
            notes.append("e.g. " + ", ".join(examples[reason][:3]))
        parts.append(f"{reason} {n}" + (f" ({'; '.join(notes)})" if notes else ""))
    return ", ".join(parts)
_CHUNK_CHARS = 1 << 20  # characters read at a time from a JSON array file


@dataclass
class Conversation:
    """One usable conversation: `id` (the record's id, else `#<index>` counted from 0: the validation
    split is keyed on it), normalized messages, the record's `source` (a prompt mixture's source name,
    data/mixture) when it has one, and `ref`, where it is for a person (`line 4 id=x`, counted from 1
    as ReadStats' examples are; "" when not read from a file)."""

    id: str
    messages: list[dict[str, str]]
    source: str | None = None
    ref: str = ""

    @property
    def where(self) -> str:
        """How a message names this conversation: its `ref`, else its id."""
        return self.ref or self.id


@dataclass
class ReadStats:
    """What the reader saw. Invariant: `read == kept + sum(skipped.values())`.

    `skipped` counts records by reason; `examples[reason]` holds the first `NUM_EXAMPLES` record
    references, counted from 1 as an editor does: `line N` of a JSONL file, `record N` of a JSON
    array, with ` id=...` when the record has one. `leading_assistant_dropped` / `trailing_turns_dropped`
    count turns removed from kept conversations.
    """

    read: int = 0
    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    leading_assistant_dropped: int = 0
    trailing_turns_dropped: int = 0
    unit: str = "line"  # what a record index counts: "line" (JSONL) or "record" (a JSON array's elements)

    def skip(self, reason: str, ref: str) -> None:
        self.skipped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < NUM_EXAMPLES:
            ex.append(ref)

    def reject(self, reason: str, ref: str) -> None:
        """Move a conversation this reader kept to `skipped` (a later stage could not use it)."""
        self.kept -= 1
        self.skip(reason, ref)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


class RecordSkipped(Exception):
    """A record the trainer cannot use; `reason` is the count key (e.g. "no_user_turn")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def normalize_record(record: Any, stats: ReadStats | None = None) -> list[dict[str, str]]:
    """Normalized messages of one record; raises `RecordSkipped(reason)` when the record is unusable."""
    if not isinstance(record, dict):
        raise RecordSkipped("not_an_object")
    if "conversations" in record:
        turns = record["conversations"]
    elif "messages" in record:
        turns = record["messages"]
    else:
        raise RecordSkipped("missing_conversations")
    if not isinstance(turns, list):
        raise RecordSkipped("conversations_not_a_list")
    if not turns:
        raise RecordSkipped("empty_conversation")
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RecordSkipped("turn_not_an_object")
        role = turn.get("from", turn.get("role"))
        content = turn["value"] if "value" in turn else turn.get("content")
        if role is None or ("value" not in turn and "content" not in turn):
            raise RecordSkipped("turn_missing_keys")
        if not isinstance(role, str) or role.lower() not in ROLE_MAP:
            raise RecordSkipped("unknown_role")
        if not isinstance(content, str):
            raise RecordSkipped("non_string_content")
        if not content.strip():
            raise RecordSkipped("empty_turn")
        messages.append({"role": ROLE_MAP[role.lower()], "content": content})

    # Assistant turns before the first user turn have nothing to answer: drop them.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise RecordSkipped("no_user_turn")
    leading = sum(m["role"] == "assistant" for m in messages[:first_user])
    if leading:
        messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise RecordSkipped("no_assistant_turn")
    trailing = len(messages) - 1 - last_assistant
    messages = messages[: last_assistant + 1]
    if stats is not None:
        stats.leading_assistant_dropped += leading
        stats.trailing_turns_dropped += trailing
    return messages


def _ref(index: int, record: Any, unit: str) -> str:
    """`line 4 id=x`: the record's place counted from 1 (index is 0-based), and its id when it has one."""
    rid = record.get("id") if isinstance(record, dict) else None
    return f"{unit} {index + 1} id={rid}" if isinstance(rid, (str, int)) else f"{unit} {index + 1}"


def _conversation_id(index: int, record: Any) -> str:
    rid = record.get("id") if isinstance(record, dict) else None
    return str(rid) if isinstance(rid, (str, int)) else f"#{index}"


def iter_records(path: str | Path, stats: ReadStats, start: int = 0) -> Iterator[tuple[int, Any]]:
    """(index, parsed record) for each record of a JSON array or JSONL file (index: the line
    number in JSONL, blank lines included; the element number in an array).

    Lines of JSONL that are not valid JSON are counted as `invalid_json`. A JSON array that ends
    without its closing bracket (or with an element that does not parse) stops there: the tail is
    counted once as `truncated_tail`. start: JSONL lines before it are skipped unparsed and
    uncounted (an array is parsed from its beginning regardless).
    """
    path = Path(path)
    with path.open("r", encoding="utf-8") as f:
        head = f.read(4096)
        first = head.lstrip()[:1]
        f.seek(0)
        if first == "[" and path.suffix.lower() != ".jsonl":
            stats.unit = "record"
            yield from _iter_json_array(f, stats)
            return
        for index, line in enumerate(f):
            if index < start or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                stats.read += 1
                stats.skip("invalid_json", f"line {index + 1}")
                continue
            yield index, record


def _iter_json_array(f, stats: ReadStats) -> Iterator[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    buf = f.read(_CHUNK_CHARS)
    pos = buf.index("[") + 1
    eof = False
    index = 0
    while True:
        # Skip whitespace and the separating comma, reading more when the buffer runs out.
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or eof:
                break
            buf, pos = f.read(_CHUNK_CHARS), 0
            eof = not buf
        if pos >= len(buf):  # no closing bracket and nothing left
            return
        if buf[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, pos)
            if end == len(buf) and not eof:  # a bare number cut by the chunk edge parses short
                raise json.JSONDecodeError("element may continue", buf, end)
        except json.JSONDecodeError:
            if not eof:
                chunk = f.read(_CHUNK_CHARS)
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0
                continue
            stats.read += 1
            stats.skip("truncated_tail", f"record {index + 1} ({len(buf) - pos} chars)")
            return
        pos = end
        if pos > _CHUNK_CHARS:  # drop what was parsed so the buffer stays small
            buf, pos = buf[pos:], 0
        yield index, record
        index += 1


def iter_conversations(path: str | Path, stats: ReadStats) -> Iterator[Conversation]:
    """Usable conversations of a chat file, in file order; every other record is counted in `stats`.

    Lazy: stopping the iteration stops reading the file (the 125 MB ShareGPT file is never read
    whole when only a few hundred conversations are needed).
    """
    for index, record in iter_records(path, stats):
        stats.read += 1
        try:
            messages = normalize_record(record, stats)
        except RecordSkipped as e:
            stats.skip(e.reason, _ref(index, record, stats.unit))
            continue
        stats.kept += 1
        source = record.get("source")
        yield Conversation(id=_conversation_id(index, record), messages=messages,
                           source=source if isinstance(source, str) else None, ref=_ref(index, record, stats.unit))
