"""Mixture records, the rule their roles follow, and the per-source report.

A record is `{"id": "<source>/<n>", "source": "<name>", "messages": [{"role", "content"}, ...]}`;
the roles follow the convention of the package docstring (data/mixture/__init__.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pydantic import BaseModel, Field

NUM_EXAMPLES = 5  # record references kept per skip reason

Messages = list[dict[str, str]]


def make_record(source: str, n: int, messages: Messages) -> dict[str, Any]:
    """The record for item `n` of `source` (n: the item's index in that source's own order)."""
    return {"id": f"{source}/{n}", "source": source, "messages": messages}


def user_texts(record: dict[str, Any]) -> list[str]:
    """Contents of the record's user turns, in order."""
    return [m["content"] for m in record["messages"] if m["role"] == "user"]


def convention_problem(messages: Messages) -> str | None:
    """Why `messages` break the record convention (a skip reason), or None when they follow it.

    Allowed: an optional system message first, then either user/assistant pairs ending with an
    assistant turn (a conversation with answers), or one or more user turns and nothing else (a
    prompt-only record). Every content is a non-empty string.
    """
    if not messages:
        return "no_messages"
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant"):
            return "unknown_role"
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            return "empty_turn"
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles[0] == "system" else roles
    if not body:
        return "no_user_turn"
    if "system" in body:
        return "system_not_first"
    if "assistant" not in body:
        return None  # prompt-only: user turns only
    if len(body) % 2 or body != ["user", "assistant"] * (len(body) // 2):
        return "roles_do_not_alternate"
    return None


class SourceReport(BaseModel):
    """What one source gave. Invariant: every item the source produced is either a record or
    counted under a reason in `skipped` (with the first few references in `skip_examples`)."""

    name: str  # the name its records carry (`source` field)
    kind: str  # sharegpt | math | chitchat | code | evals | file
    licence: str
    package: str | None = None  # PyPI distribution the text comes from (None: a file / several packages)
    version: str | None = None
    count: int | None = None  # the spec's cap
    records: int = 0
    user_turns: int = 0
    assistant_turns: int = 0
    system_turns: int = 0
    skipped: dict[str, int] = Field(default_factory=dict)
    skip_examples: dict[str, list[str]] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)  # per kind: modules, packages, held-out slice ...
    seconds: float = 0.0

    def skip(self, reason: str, ref: str, num: int = 1) -> None:
        """Count `num` items skipped for `reason`; `ref` names the first of them."""
        self.skipped[reason] = self.skipped.get(reason, 0) + num
        examples = self.skip_examples.setdefault(reason, [])
        if len(examples) < NUM_EXAMPLES:
            examples.append(ref)

    def add(self, record: dict[str, Any]) -> None:
        """Count a kept record and its turns by role."""
        roles = Counter(m["role"] for m in record["messages"])
        self.records += 1
        self.user_turns += roles["user"]
        self.assistant_turns += roles["assistant"]
        self.system_turns += roles["system"]

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())
