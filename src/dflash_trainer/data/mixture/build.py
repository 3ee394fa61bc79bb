"""Build a mixture from its spec, and write it: `build_mixture(spec)` → records + report;
`write_mixture` → OUT (JSONL, one record a line) and OUT.report.json.

Per source, in spec order, every item the source yields is checked in turn and either kept or
counted under a skip reason:
  <convention reason>  roles or contents break the record convention (records.convention_problem)
  eval_leak            a user turn matches MT-Bench / HumanEval (leaks.find_eval_leaks)
  same_as_heldout      its system + user turns equal those of a held-out ShareGPT conversation
                       (checked when the spec has a sharegpt source)
  duplicate            its system + user turns equal an earlier record's (with `dedupe`)
until `count` records are kept (or the source ends). Then all records are shuffled by the seed.
The same spec on the same installed packages gives the same records in the same order.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import platform
import random
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from dflash_trainer.data.mixture.chatfiles import iter_chat_file, iter_sharegpt
from dflash_trainer.data.mixture.chitchat import iter_chitchat
from dflash_trainer.data.mixture.code_prompts import iter_code
from dflash_trainer.data.mixture.leaks import EvalIndex, find_eval_leaks, normalize
from dflash_trainer.data.mixture.licences import source_licence
from dflash_trainer.data.mixture.maths import iter_math
from dflash_trainer.data.mixture.records import Messages, SourceReport, convention_problem, make_record
from dflash_trainer.data.mixture.spec import MixtureSpec, SourceSpec

NUM_LEAK_EXAMPLES = 20


class LeakCheck(BaseModel):
    """What the eval-leak check compared and dropped."""

    mt_bench_and_humaneval_texts: int
    humaneval_functions: int
    user_turns_checked: int = 0
    records_dropped: int = 0
    examples: list[dict[str, Any]] = Field(default_factory=list)  # first leaks: record, turn, eval id, rule
    heldout_prompt_keys: int | None = None  # distinct prompts of the ShareGPT held-out tail (None: not compared)


class MixtureReport(BaseModel):
    """The whole build: spec, totals, per-source reports, the leak check (OUT.report.json)."""

    format_version: int = 1
    spec: dict[str, Any]
    spec_build_sha256: str = ""  # MixtureSpec.build_sha256(): what `regenerate --spec` matches its cached prompts by
    records: int
    user_turns: int
    assistant_turns: int
    sources: list[SourceReport]
    eval_leak_check: LeakCheck
    seconds: float
    python: str
    output: dict[str, Any] | None = None  # path, bytes, sha256: filled by write_mixture


@dataclass
class Mixture:
    """Built records (in their final order) and the report."""

    records: list[dict[str, Any]]
    report: MixtureReport


def _source_items(src: SourceSpec, seed: int, report: SourceReport,
                  index: EvalIndex) -> Generator[tuple[int, Messages], None, None]:
    if src.kind == "sharegpt":
        return iter_sharegpt(src, report)
    if src.kind == "math":
        return iter_math(src, seed, report)
    if src.kind == "chitchat":
        return iter_chitchat(src, report)
    if src.kind == "code":
        return iter_code(src, seed, report, index.humaneval_names)
    return iter_chat_file(src, report)


def prompt_key(messages: Messages) -> bytes:
    """Digest of the normalized system and user turns (what `dedupe` and the held-out check compare)."""
    text = "\x00".join(f"{m['role']}:{normalize(m['content'])}" for m in messages if m["role"] != "assistant")
    return hashlib.sha1(text.encode("utf-8")).digest()


def heldout_keys() -> frozenset[bytes]:
    """Prompt keys of the held-out ShareGPT conversations (data/sources.py); read once per process."""
    from dflash_trainer.data.sources import default_sharegpt_path

    path = default_sharegpt_path()
    st = path.stat()
    return _heldout_keys(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _heldout_keys(path: str, size: int, mtime_ns: int) -> frozenset[bytes]:
    from dflash_trainer.data.chat import ReadStats, iter_conversations
    from dflash_trainer.data.sources import sharegpt_heldout_start

    tail = itertools.islice(iter_conversations(path, ReadStats()), sharegpt_heldout_start(path), None)
    return frozenset(prompt_key(c.messages) for c in tail)


def build_mixture(spec: MixtureSpec, *, eval_index: EvalIndex | None = None,
                  log: Callable[[str], None] | None = None) -> Mixture:
    """Build the records of `spec` (module docstring) and their report.

    `eval_index` defaults to `EvalIndex.load()`; `log` gets one line per finished source.
    Raises FileNotFoundError naming the install command when a source's package (or an eval
    package the leak check needs) is missing, ValueError for an option that selects nothing.
    """
    t0 = time.perf_counter()
    index = eval_index or EvalIndex.load()
    check = LeakCheck(mt_bench_and_humaneval_texts=len(index.texts), humaneval_functions=len(index.functions))
    heldout: frozenset[bytes] = frozenset()
    if any(s.kind == "sharegpt" for s in spec.sources):
        heldout = heldout_keys()
        check.heldout_prompt_keys = len(heldout)
    seen: set[bytes] = set()
    kept: list[list[dict[str, Any]]] = []
    reports = []
    for src in spec.sources:
        t = time.perf_counter()
        report = SourceReport(name=src.name, kind=src.kind, licence=source_licence(src.name), count=src.count)
        records: list[dict[str, Any]] = []
        items = _source_items(src, spec.seed, report, index)
        try:
            for n, messages in items:
                record = make_record(src.name, n, messages)
                problem = convention_problem(messages)
                if problem:
                    report.skip(problem, record["id"])
                    continue
                leaks = find_eval_leaks([record], index)
                check.user_turns_checked += sum(m["role"] == "user" for m in messages)
                if leaks:
                    report.skip("eval_leak", record["id"])
                    check.records_dropped += 1
                    check.examples += [vars(x) for x in leaks][: max(0, NUM_LEAK_EXAMPLES - len(check.examples))]
                    continue
                key = prompt_key(messages)
                if key in heldout:
                    report.skip("same_as_heldout", record["id"])
                    continue
                if spec.dedupe:
                    if key in seen:
                        report.skip("duplicate", record["id"])
                        continue
                    seen.add(key)
                records.append(record)
                report.add(record)
                if src.count is not None and len(records) >= src.count:
                    break
        finally:
            items.close()  # stops generator processes, finishes the source's counts
        report.seconds = round(time.perf_counter() - t, 2)
        kept.append(records)
        reports.append(report)
        if log:
            log(f"{src.name}: {report.records} records, {report.user_turns} user turns, {report.num_skipped} skipped "
                f"({report.seconds:.1f} s)")
    records = [r for rs in kept for r in rs]
    random.Random(spec.seed).shuffle(records)
    report = MixtureReport(spec=spec.model_dump(), spec_build_sha256=spec.build_sha256(), records=len(records),
                           user_turns=sum(r.user_turns for r in reports),
                           assistant_turns=sum(r.assistant_turns for r in reports), sources=reports,
                           eval_leak_check=check, seconds=round(time.perf_counter() - t0, 2),
                           python=platform.python_version())
    return Mixture(records, report)


def report_path(out: str | Path) -> Path:
    """Where the report of output file `out` goes: `<out>.report.json`."""
    return Path(f"{out}.report.json")


def write_mixture(mixture: Mixture, out: str | Path) -> Path:
    """Write the records to `out` as JSONL (UTF-8, atomically: a temporary file renamed) and the
    report, with the output's size and sha256, to `<out>.report.json`; returns the report path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        for record in mixture.records:
            line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
            digest.update(line)
            f.write(line)
    os.replace(tmp, out)
    mixture.report.output = {"path": str(out), "bytes": out.stat().st_size, "sha256": digest.hexdigest()}
    path = report_path(out)
    path.write_text(mixture.report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path


def summary_lines(report: MixtureReport) -> list[str]:
    """The report for a console: one line per source (records, user turns, skips by reason,
    package and licence), then the totals and the leak check."""
    lines = []
    for s in report.sources:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(s.skipped.items(), key=lambda kv: -kv[1]))
        origin = f"{s.package}=={s.version}" if s.package else s.kind
        lines.append(f"{s.name}: {s.records} records, {s.user_turns} user turns, {s.assistant_turns} assistant turns; "
                     f"skipped {s.num_skipped}{f' ({skipped})' if skipped else ''}; {origin}; licence: {s.licence}")
        failed = s.details.get("modules_failed")
        if s.kind == "math":
            lines.append(f"  math modules: {len(s.details.get('modules_ran', []))} ran, {len(failed or {})} failed"
                         + (f" ({', '.join(failed)})" if failed else ""))
        if s.kind == "code":
            lines += [f"  {name}=={p['version']} ({p['licence']}): {p['definitions']} definitions"
                      for name, p in s.details.get("packages", {}).items()]
    c = report.eval_leak_check
    lines.append(f"total: {report.records} records, {report.user_turns} user turns in {report.seconds:.0f} s; "
                 f"eval-leak check: {c.user_turns_checked} user turns against {c.mt_bench_and_humaneval_texts} "
                 f"MT-Bench/HumanEval texts, {c.records_dropped} records dropped")
    return lines
