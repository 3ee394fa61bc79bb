"""The turn-level work of `dflash-train regenerate` (data/regenerate.py): one record's cursor over
its turns while the target answers them, and the answer slots of prompt-only records."""

from __future__ import annotations

import copy
from typing import Any

from dflash_trainer.data.chat import ROLE_MAP
from dflash_trainer.data.responders import Conversation, Response


class RecordInProgress:
    """A record being regenerated: its copy, the turn list, the cursor over its turns and its counts
    (data/regenerate.py's module docstring says what happens to each turn)."""

    def __init__(self, index: int, record: dict[str, Any], drop_truncated: bool = False):
        self.index = index
        self.drop_truncated = drop_truncated
        self.record = copy.deepcopy(record)
        self.turns: list[dict[str, Any]] = self.record["conversations" if "conversations" in record else "messages"]
        self.context: Conversation = []
        self.cursor = 0
        self.waiting: int | None = None  # turn index whose response is being generated
        self.last_done: int | None = None  # index of the last regenerated assistant turn
        self.regenerated = 0
        self.truncated = 0
        self.looped = 0
        self.cut_turns = 0
        self.budget_cut = False  # ended early by the time budget (cut_after_last_answer)
        self.error: str | None = None

    def next_prompt(self) -> Conversation | None:
        """The conversation before the next assistant turn to regenerate, or None when done."""
        while self.cursor < len(self.turns):
            i = self.cursor
            turn = self.turns[i]
            role = ROLE_MAP[str(turn.get("from", turn.get("role"))).lower()]
            content = turn["value"] if "value" in turn else turn["content"]
            self.cursor += 1
            if role != "assistant":
                self.context.append({"role": role, "content": content})
            elif any(m["role"] == "user" for m in self.context):
                self.waiting = i
                return list(self.context)
            # an assistant turn before any user turn answers nothing: left as it is
        return None

    def answer(self, response: Response) -> None:
        assert self.waiting is not None
        if self.drop_truncated and not response.error and not response.finished:
            response = Response(text="", finished=False, error="truncated")  # cut here like a too-long prompt
        if response.error in ("prompt_too_long", "truncated") and self.last_done is not None:
            self._cut()  # keep the conversation up to the last regenerated answer
            return
        if response.error or not response.text.strip():
            self.error = response.error or "empty_response"
            self.cursor = len(self.turns)
            return
        turn = self.turns[self.waiting]
        turn["value" if "value" in turn else "content"] = response.text
        turn.pop("truncated", None)  # marks from an earlier regeneration of this file say nothing now
        turn.pop("looped", None)
        if response.looped:
            turn["looped"] = True
        elif not response.finished:
            turn["truncated"] = True
        self.context.append({"role": "assistant", "content": response.text})
        self.regenerated += 1
        self.looped += response.looped
        self.truncated += not response.finished and not response.looped
        self.last_done, self.waiting = self.waiting, None

    def _cut(self) -> None:
        """Drop every turn after the last regenerated answer (counted in cut_turns)."""
        self.cut_turns = len(self.turns) - (self.last_done + 1)
        del self.turns[self.last_done + 1:]
        self.cursor = len(self.turns)

    def cut_after_last_answer(self) -> None:
        """End the record after its last regenerated answer because the time budget ran out: the
        turns after it are dropped (counted in cut_turns) and the record is marked budget_cut.
        Raises ValueError when no turn was regenerated yet (nothing to keep)."""
        if self.last_done is None:
            raise ValueError(f"record {self.index}: no regenerated turn to cut after")
        self._cut()
        self.waiting = None
        self.budget_cut = True

    def entry(self) -> dict[str, Any]:
        """The partial-file line of a finished record."""
        e: dict[str, Any] = {"index": self.index, "status": "failed" if self.error else "ok", "reason": self.error,
                             "regenerated": self.regenerated, "truncated": self.truncated, "cut_turns": self.cut_turns,
                             "looped": self.looped, "budget_cut": self.budget_cut, "source": self.record.get("source")}
        if not self.error:
            e["record"] = self.record
        return e


def with_answer_slots(record: Any, placeholder: str = "") -> Any:
    """A copy of `record` with an assistant turn inserted after every user turn that no assistant
    turn follows (module docstring), in the record's own turn format; other records unchanged.
    `placeholder` is the inserted turns' content."""
    if not isinstance(record, dict):
        return record
    key = "conversations" if "conversations" in record else "messages" if "messages" in record else None
    turns = record.get(key) if key else None
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return record

    def role(t: dict[str, Any]) -> str | None:
        r = t.get("from", t.get("role"))
        return ROLE_MAP.get(r.lower()) if isinstance(r, str) else None

    out: list[Any] = []
    for i, t in enumerate(turns):
        out.append(t)
        nxt = role(turns[i + 1]) if i + 1 < len(turns) else None
        if role(t) == "user" and nxt != "assistant":
            out.append({"from": "gpt", "value": placeholder} if "value" in t else {"role": "assistant", "content": placeholder})
    if len(out) == len(turns):
        return record
    return {**record, key: out}
