"""Task prompts from the registry of PyPI `evals==3.0.1.post1` (MIT, OpenAI Evals).

The wheel holds `evals/registry/data/<eval>/**/*.jsonl` (470 evals, 660 files, 1.01M lines, 722 MB):
each line a sample `{"input": [{"role", "content", "name"?}, ...], "ideal": ...}`. The files are read
directly (located with importlib, the package is never imported). They are heavily skewed (two evals hold
half the lines), so each eval gives at most `per_eval` samples, drawn by a seeded reservoir over its lines
(files in sorted order): the source's variety comes from the number of evals, not their size.

A sample becomes a prompt-only record (an `input` text: one user turn): its system messages without a
`name` before the first user turn, joined by a blank line, are the system turn; user messages, and system
messages named `example_user` (few-shot examples), become user turns in order; assistant messages and those
named `example_assistant` are dropped, since the target's answers replace them. Only the last
`max_user_turns` user turns are kept (the question comes last); a sample with a system message alone asks it
as the user turn. Records come out round-robin over the evals (one of each eval in turn), so a `count` cap
still spreads over every eval.
"""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trainer.data.mixture.licences import package_version
from dflash_trainer.data.mixture.records import Messages, SourceReport
from dflash_trainer.data.mixture.spec import SourceSpec
from dflash_trainer.files.packaged import package_dir

EVALS_PACKAGE = "evals"
EVALS_DATA = "registry/data"
EVALS_INSTALL = "pip install --no-deps evals==3.0.1.post1"


def registry_evals(root: Path) -> dict[str, list[Path]]:
    """{eval name: its .jsonl files, sorted} for every folder directly under `root` that holds any
    (at any depth), in name order."""
    out = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(folder.rglob("*.jsonl"))
        if files:
            out[folder.name] = files
    return out


def sample_lines(files: list[Path], k: int, rng: random.Random) -> tuple[list[tuple[int, str]], int]:
    """A uniform sample of at most `k` non-blank lines of `files` (reservoir sampling, Algorithm R): (index among
    the non-blank lines of `files`, line) in that order, and how many lines there were."""
    picked: list[tuple[int, str]] = []
    n = 0
    for path in files:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                if len(picked) < k:
                    picked.append((n, line))
                else:
                    j = rng.randrange(n + 1)
                    if j < k:
                        picked[j] = (n, line)
                n += 1
    return sorted(picked), n


def sample_messages(sample: Any, max_user_turns: int) -> tuple[Messages | None, str]:
    """(messages, "") for one registry sample (module docstring's rule), or (None, skip reason):
    `not_json_object`, `input_not_chat` (neither a text nor a list of role messages: the registry's
    structured samples for special eval classes), `content_not_text`,
    `system_after_user`, `no_user_turn`."""
    if not isinstance(sample, dict):
        return None, "not_json_object"
    chat = sample.get("input")
    if isinstance(chat, str):  # a completion-style sample: its text is the one user turn
        chat = [{"role": "user", "content": chat}]
    if not isinstance(chat, list) or not chat or not all(isinstance(m, dict) and "role" in m for m in chat):
        return None, "input_not_chat"
    if not all(isinstance(m.get("content"), str) for m in chat):
        return None, "content_not_text"
    system: str | None = None
    users: list[str] = []
    for m in chat:
        role, name, text = m["role"], m.get("name"), m["content"].strip()
        if role == "user" or (role == "system" and name == "example_user"):
            users.append(text)
        elif role == "system" and name is None:
            if users:
                return None, "system_after_user"
            system = text if system is None else f"{system}\n\n{text}"
    users = [u for u in users if u][-max_user_turns:]
    if not users and system:  # the whole task in one system message: it is the question
        system, users = None, [system]
    if not users:
        return None, "no_user_turn"
    return [*([{"role": "system", "content": system}] if system else []),
            *({"role": "user", "content": u} for u in users)], ""


def iter_evals(source: SourceSpec, seed: int, report: SourceReport) -> Iterator[tuple[int, Messages]]:
    """(place in the round-robin order over the evals, messages) of the sampled registry samples.

    Skips (counted, with examples `<eval>:<i>`, i the sample's index among the non-blank lines of the eval's
    files in sorted order): the reasons of `sample_messages`, `not_json` (a line that does not parse),
    `too_long` (system and user text over `max_chars`), `too_short` (system and user text under `min_chars`).
    Report details: evals read, lines, samples drawn per eval. Raises FileNotFoundError naming the install
    command when the package is missing, ValueError (naming the option and a close task name) when `evals` /
    `exclude` name a task the registry lacks or leave none.
    """
    opts = source.parsed
    root = package_dir(EVALS_PACKAGE, EVALS_DATA, EVALS_INSTALL, why="the evals source needs ")
    report.package, report.version = "evals", package_version(EVALS_PACKAGE)
    registry = registry_evals(root)
    for field, given in (("evals", opts.evals or []), ("exclude", opts.exclude)):
        unknown = [e for e in given if e not in registry]
        if unknown:
            close = {e: difflib.get_close_matches(e, registry, n=1) for e in unknown}
            hints = "; ".join(f"{e!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for e, c in close.items())
            raise ValueError(f"sources.{source.name}.options.{field}: {hints}: not a task of the registry at {root}; "
                             f"its {len(registry)} tasks are the folders there")
    names = [n for n in registry if (opts.evals is None or n in opts.evals) and n not in opts.exclude]
    if not names:
        raise ValueError(f"sources.{source.name}.options: `evals` and `exclude` leave no task of the registry; "
                         "name at least one task that `exclude` does not")
    drawn: dict[str, list[tuple[int, str]]] = {}
    lines = 0
    for name in names:
        # one generator per eval, seeded by (seed, name): adding or excluding an eval leaves the others' draws
        rng = random.Random(f"{seed}:evals:{name}")
        drawn[name], n = sample_lines(registry[name], opts.per_eval, rng)
        lines += n
    report.details.update(path=str(root), evals=len(names), evals_in_registry=len(registry), lines=lines,
                          drawn={n: len(v) for n, v in drawn.items()})
    n = -1  # the sample's place in the round-robin order (its record id), skipped samples included
    for rank in range(max((len(v) for v in drawn.values()), default=0)):
        for name in names:
            if rank >= len(drawn[name]):
                continue
            i, line = drawn[name][rank]
            n, ref = n + 1, f"{name}:{i}"
            try:
                sample = json.loads(line)
            except json.JSONDecodeError:
                report.skip("not_json", ref)
                continue
            messages, reason = sample_messages(sample, opts.max_user_turns)
            if messages is None:
                report.skip(reason, ref)
            elif (chars := sum(len(m["content"]) for m in messages)) > opts.max_chars:
                report.skip("too_long", ref)
            elif chars < opts.min_chars:
                report.skip("too_short", ref)
            else:
                yield n, messages
