"""No eval leakage: no training user turn may repeat an evaluation prompt, exactly or nearly.

Eval prompts (`EvalIndex.load`): MT-Bench turns (80 questions × 2), HumanEval prompts (164
function stubs with their docstrings) and every user turn of the held-out ShareGPT conversations
(data/suites.py `sharegpt-heldout`: 3,000 conversations, ~10K turns; when the ShareGPT package is
missing they are left out, and said so: `LeakCheck.missing_suites` in the report and its summary
line). Loaded once per process (`EvalIndex.load` is cached). Rules, per user turn (overlap.py
defines the normalisation):
  exact               the turn's words equal an eval prompt's of at least MIN_EXACT_WORDS (4) words;
                      shorter eval prompts are generic and matched by nothing
  near                ≥ 80 % of an eval prompt's distinct word 6-grams occur in the turn; eval
                      prompts under 6 words are matched exactly only
  humaneval_function  the turn names a HumanEval entry point (as an identifier) and contains the
                      start of that function's docstring (its first paragraph, first
                      `DOCSTRING_KEY_CHARS` characters, lower case, spaces collapsed): a request
                      to write the same function in other words
What happens to a record (`LeakCheck.apply`, the one mechanism of `mixture` and `prepare`): it is
cut before its first leaking user turn (the system message and the earlier turns with their
answers stay); a record whose first user turn leaks is dropped. Counted in `LeakCheck`.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from dflash_trainer.data.mixture.overlap import MIN_EXACT_WORDS, EvalText, OverlapIndex
from dflash_trainer.data.sources import SHAREGPT_INSTALL
from dflash_trainer.data.suites import humaneval_tasks, load_suite, mt_bench

DOCSTRING_KEY_CHARS = 60
NUM_LEAK_EXAMPLES = 20
RULES = ("exact", "near", "humaneval_function")  # a turn breaking several is counted under the first
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower case with every run of whitespace made one space, stripped (the dedupe key's form)."""
    return _SPACE.sub(" ", text).strip().lower()


@dataclass(frozen=True)
class Leak:
    """One flagged user turn: record id, index among its user turns, eval item id, its suite, rule."""

    record_id: str
    turn: int
    eval_id: str
    suite: str
    rule: str  # exact | near | humaneval_function


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
    """The eval prompts to check against (`texts`, in suite order), the HumanEval entry points
    with docstring keys (`functions`) and the suites left out because their package is missing
    (`missing`: suite → why and the install command). Read-only once built (shared by the cache)."""

    def __init__(self, texts: list[EvalText], functions: list[HumanEvalFunction],
                 missing: dict[str, str] | None = None):
        self.texts = list(texts)
        self.functions = functions
        self.missing = dict(missing or {})
        self.overlap = OverlapIndex(self.texts)

    @classmethod
    def load(cls, heldout: bool = True) -> "EvalIndex":
        """MT-Bench turns and HumanEval prompts from their packages, and with `heldout` the user
        turns of the held-out ShareGPT conversations; built once per process and value of `heldout`
        (`load_eval_index`, cached: every `prepare` and mixture build of a process shares it). A
        missing ShareGPT package leaves that suite out and names it in `missing` (never silently).
        Raises FileNotFoundError with the install command when MT-Bench or HumanEval is missing
        (the check cannot run without them)."""
        return load_eval_index(heldout)

    @property
    def humaneval_names(self) -> frozenset[str]:
        """HumanEval entry point names (the code source never builds a request for one)."""
        return frozenset(f.name for f in self.functions)

    def suite_sizes(self) -> dict[str, int]:
        """Eval prompts per suite."""
        out: dict[str, int] = {}
        for t in self.texts:
            out[t.suite] = out.get(t.suite, 0) + 1
        return out

    def text_leaks(self, text: str) -> list[tuple[str, str, str]]:
        """(eval id, suite, rule) for each eval prompt and rule `text` (one user turn, raw) breaks."""
        out = [(self.texts[i].eval_id, self.texts[i].suite, rule) for i, rule in self.overlap.matches(text)]
        if self.functions:
            t = normalize(text)
            for f in self.functions:
                name = f.name.lower()  # t is lower case; entry points such as digitSum are not
                if name in t and f.docstring_key in t and re.search(rf"(?<!\w){re.escape(name)}(?!\w)", t):
                    out.append((f.eval_id, "humaneval", "humaneval_function"))
        return out


@functools.lru_cache(maxsize=2)
def load_eval_index(heldout: bool = True) -> EvalIndex:
    """`EvalIndex.load`'s work, once per process and `heldout` (`load_eval_index.cache_clear()`
    forgets it): MT-Bench and HumanEval from their packages (FileNotFoundError with the install
    command when missing; a failed load is not cached), with `heldout` the held-out ShareGPT turns,
    or `missing["sharegpt-heldout"]` saying that package is missing."""
    texts = [EvalText(f"{p.id}#{i + 1}", "mt-bench", t) for p in mt_bench() for i, t in enumerate(p.user_turns)]
    functions = []
    for task in humaneval_tasks(why="the eval-leak check needs HumanEval: "):
        texts.append(EvalText(task["task_id"], "humaneval", task["prompt"]))
        key = _docstring_key(task["prompt"], task["entry_point"])
        if key:
            functions.append(HumanEvalFunction(task["task_id"], task["entry_point"], key))
    missing = {}
    if heldout:
        try:
            held = load_suite("sharegpt-heldout")
        except FileNotFoundError:
            held = []
            missing["sharegpt-heldout"] = f"its package is missing: {SHAREGPT_INSTALL}"
        texts += [EvalText(f"{p.id}#{i + 1}", "sharegpt-heldout", t) for p in held for i, t in enumerate(p.user_turns)]
    return EvalIndex(texts, functions, missing)


def find_eval_leaks(records: Iterable[dict[str, Any]], index: EvalIndex | None = None) -> list[Leak]:
    """Every user turn of `records` that breaks a rule of the module docstring (empty = clean).

    `index` defaults to `EvalIndex.load()` (reads the eval packages).
    """
    index = index or EvalIndex.load()
    leaks = []
    for record in records:
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        for i, text in enumerate(users):
            leaks += [Leak(str(record.get("id")), i, e, s, r) for e, s, r in index.text_leaks(text)]
    return leaks


def cut_before(messages: list[dict[str, str]], user_turn: int) -> list[dict[str, str]] | None:
    """`messages` up to (not including) user turn number `user_turn` (0-based among user turns);
    None when nothing of the conversation would remain (user_turn 0)."""
    seen = 0
    for j, m in enumerate(messages):
        if m["role"] == "user":
            if seen == user_turn:
                return messages[:j] if user_turn > 0 else None
            seen += 1
    return messages


class LeakCheck(BaseModel):
    """What the eval-leak check compared and what it removed (the mixture report's
    `eval_leak_check`, prepare_report.json's `eval_leak_check`). Turn counts are of user turns."""

    eval_prompts: dict[str, int]  # per suite: prompts compared against
    humaneval_functions: int
    generic_eval_prompts: int = 0  # eval prompts under overlap.MIN_EXACT_WORDS words: matched by nothing
    missing_suites: dict[str, str] = Field(default_factory=dict)  # suite → why it was not checked (package missing)
    user_turns_checked: int = 0
    leaking_turns: int = 0  # turns that break a rule (all of a record's, also those past its cut)
    by_rule: dict[str, int] = Field(default_factory=dict)  # leaking turns by their first rule in RULES order
    by_suite: dict[str, int] = Field(default_factory=dict)  # leaking turns per suite they match (one turn: each suite once)
    by_source: dict[str, int] = Field(default_factory=dict)  # leaking turns per record source
    records_dropped: int = 0  # the first user turn leaks
    records_cut: int = 0  # cut before a later leaking turn
    user_turns_removed: int = 0  # by drops and cuts
    examples: list[dict[str, Any]] = Field(default_factory=list)  # first leaks: record, turn, eval id, suite, rule

    @classmethod
    def start(cls, index: EvalIndex) -> "LeakCheck":
        """Empty counts for checks against `index`."""
        return cls(eval_prompts=index.suite_sizes(), humaneval_functions=len(index.functions),
                   generic_eval_prompts=index.overlap.generic, missing_suites=dict(index.missing))

    def apply(self, index: EvalIndex, record_id: str, source: str, messages: list[dict[str, str]]
              ) -> list[dict[str, str]] | None:
        """Check every user turn of one record and count; returns the messages to keep: all of them
        (clean), those before the first leaking user turn (cut), or None (dropped)."""
        users = [m["content"] for m in messages if m["role"] == "user"]
        self.user_turns_checked += len(users)
        first = None
        for i, text in enumerate(users):
            hits = index.text_leaks(text)
            if not hits:
                continue
            first = i if first is None else first
            self.leaking_turns += 1
            rule = next(r for r in RULES if any(h[2] == r for h in hits))
            self.by_rule[rule] = self.by_rule.get(rule, 0) + 1
            for suite in sorted({h[1] for h in hits}):
                self.by_suite[suite] = self.by_suite.get(suite, 0) + 1
            self.by_source[source] = self.by_source.get(source, 0) + 1
            if len(self.examples) < NUM_LEAK_EXAMPLES:
                e, s, r = next(h for h in hits if h[2] == rule)
                self.examples.append(vars(Leak(record_id, i, e, s, r)))
        if first is None:
            return messages
        self.user_turns_removed += len(users) - first
        kept = cut_before(messages, first)
        if kept is None:
            self.records_dropped += 1
        else:
            self.records_cut += 1
        return kept

    def summary(self, seconds: float | None = None) -> str:
        """One console line: what was compared (in `seconds`, the check's wall time, when given; kept
        out of the model so that prepare's report stays byte-deterministic), leaking turns by rule,
        suite and source, drops and cuts."""
        suites = ", ".join(f"{k} {v}" for k, v in self.eval_prompts.items())
        parts = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"  # noqa: E731
        missing = "".join(f" (NOT against {k}: {v})" for k, v in sorted(self.missing_suites.items()))
        return (f"eval-leak check{missing}: {self.user_turns_checked} user turns against {sum(self.eval_prompts.values())} eval "
                f"prompts ({suites}; {self.generic_eval_prompts} generic ones under {MIN_EXACT_WORDS} words matched by nothing)"
                f"{'' if seconds is None else f' in {seconds:.1f} s'}; {self.leaking_turns} leaking turns (by rule: "
                f"{parts(self.by_rule)}; by suite: {parts(self.by_suite)}; by source: {parts(self.by_source)}); "
                f"{self.records_dropped} records dropped, {self.records_cut} cut, {self.user_turns_removed} user turns "
                f"removed")
