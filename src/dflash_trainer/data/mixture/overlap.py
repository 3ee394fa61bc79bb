"""Overlap of a training turn with evaluation prompts: exact after normalisation, or near by word
6-gram containment. Pure text in, matches out; no files (leaks.py loads the prompts).

Normalisation (`words`): lower case, then the maximal runs of letters and digits (Unicode; `_`
and every punctuation or space character separate words). "Hello,   World!" and "hello world"
are the same text; "don't" is the two words "don" "t".

Rules, for a training text t and an eval prompt e (both normalised):
  exact   words(t) == words(e), for e of at least MIN_EXACT_WORDS (4) words: shorter eval turns
          ("continue", "thank you", "go on": 3,000 held-out ShareGPT conversations hold hundreds)
          are generic, identify no prompt, and would cut most multi-turn training records; they are
          counted (`generic_eval_prompts`) and matched by nothing
  near    e has ≥ NGRAM words and ≥ NEAR_NUM / NEAR_DEN (80 %) of e's distinct word 6-grams occur
          in t: |G(e) ∩ G(t)| · NEAR_DEN ≥ |G(e)| · NEAR_NUM, integers, so 80 of 100 is caught
          and 79 of 100 is not. An eval prompt shorter than NGRAM words is matched exactly only.
The near rule is the containment form of shingle resemblance (A. Broder, "On the resemblance and
containment of documents", 1997) on exact 6-gram sets instead of MinHash sketches: the sets are
small enough to keep whole. A text containing e word for word (≥ 6 words) therefore matches.

Speed: an inverted index from each eval 6-gram (a string key, hashed by the dict) to the eval
prompts holding it; a training text costs one lookup per distinct 6-gram whose words all occur
in some eval prompt (the others cannot match and are never joined).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

NGRAM = 6
MIN_EXACT_WORDS = 4
NEAR_NUM, NEAR_DEN = 4, 5  # 80 %
_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """The normalised words of `text` (module docstring): lower case letter/digit runs, in order."""
    return _WORD.findall(text.lower())


def grams(ws: list[str]) -> set[str]:
    """Distinct word NGRAM-grams of a word list, each as its words joined by one space; empty
    below NGRAM words."""
    return {" ".join(ws[i:i + NGRAM]) for i in range(len(ws) - NGRAM + 1)}


@dataclass(frozen=True)
class EvalText:
    """One eval prompt: its id (e.g. `mt-bench/81#1`), suite (`mt-bench` | `humaneval` |
    `sharegpt-heldout`) and raw text."""

    eval_id: str
    suite: str
    text: str


class OverlapIndex:
    """Exact keys and the 6-gram inverted index of a list of eval prompts (module docstring).

    `prompts[i]` is an `EvalText`; `need[i]` the 6-gram hits prompt i needs (0: exact only)."""

    def __init__(self, prompts: Iterable[EvalText]):
        self.prompts = list(prompts)
        self.exact: dict[str, list[int]] = {}
        self.index: dict[str, list[int]] = {}
        self.vocab: set[str] = set()
        self.need: list[int] = []
        self.generic = 0  # eval prompts of 1..MIN_EXACT_WORDS-1 words: matched by nothing
        for i, p in enumerate(self.prompts):
            ws = words(p.text)
            if len(ws) >= MIN_EXACT_WORDS:
                self.exact.setdefault(" ".join(ws), []).append(i)
            elif ws:
                self.generic += 1
            g = grams(ws)
            for key in g:
                self.index.setdefault(key, []).append(i)
            if g:
                self.vocab.update(ws)
            self.need.append(-(-len(g) * NEAR_NUM // NEAR_DEN))  # ceil(0.8 · |G(e)|)

    def matches(self, text: str) -> list[tuple[int, str]]:
        """(prompt index, "exact" | "near") for every eval prompt `text` matches, by index; a
        prompt matched exactly is not listed again as near."""
        ws = words(text)
        out = {i: "exact" for i in self.exact.get(" ".join(ws), ())} if ws else {}
        if len(ws) >= NGRAM and self.index:
            known = [w in self.vocab for w in ws]
            run, keys = 0, set()
            for j, ok in enumerate(known):  # a gram can hit only when all its words are eval words
                run = run + 1 if ok else 0
                if run >= NGRAM:
                    keys.add(" ".join(ws[j - NGRAM + 1:j + 1]))
            hits: Counter[int] = Counter()
            for key in keys:
                hits.update(self.index.get(key, ()))
            for i, n in hits.items():
                if i not in out and n >= self.need[i]:
                    out[i] = "near"
        return sorted(out.items())
