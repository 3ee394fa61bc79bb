"""Build a mixture from its spec, and write it: `build_mixture(spec)` → records + report;
`write_mixture` → OUT (JSONL, one record a line) and OUT.report.json.

Per source, in spec order, every item the source yields is checked in turn and either kept or
counted under a skip reason:
  <convention reason>  roles or contents break the record convention (records.convention_problem)
  eval_leak            its first user turn repeats an eval prompt: MT-Bench, HumanEval or a held-out
                       ShareGPT turn (leaks.py rules); a record whose later turn does is cut before
                       that turn and kept (counted in the report's `eval_leak_check`)
  duplicate            its system + user turns (after any cut) equal an earlier record's (with `dedupe`)
until `count` records are kept (or the source ends). Then all records are shuffled by the seed.
The same spec on the same installed packages gives the same records in the same order.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from dflash_trainer.data.mixture.chatfiles import iter_chat_file, iter_sharegpt
from dflash_trainer.data.mixture.chitchat import iter_chitchat
from dflash_trainer.data.mixture.code_prompts import iter_code
from dflash_trainer.data.mixture.evals_registry import iter_evals
from dflash_trainer.data.mixture.leaks import EvalIndex, LeakCheck, normalize
from dflash_trainer.data.mixture.licences import source_licence
from dflash_trainer.data.mixture.maths import iter_math
from dflash_trainer.data.mixture.records import Messages, SourceReport, convention_problem, make_record
from dflash_trainer.data.mixture.spec import MixtureSpec, SourceSpec

class MixtureReport(BaseModel):
    """The whole build: spec, totals, per-source reports, the leak check (OUT.report.json)."""

    format_version: int = 2  # 2: eval_leak_check compares held-out ShareGPT turns too, exact and near (leaks.py)
    spec: dict[str, Any]
    spec_build_sha256: str = ""  # MixtureSpec.build_sha256(): what `regenerate --spec` matches its cached prompts by
    records: int
    user_turns: int
    assistant_turns: int
    sources: list[SourceReport]
    eval_leak_check: LeakCheck
    eval_leak_check_seconds: float = 0.0  # host wall time of the check (all sources)
    seconds: float
    python: str
    output: dict[str, Any] | None = None  # path, bytes, sha256: filled by write_mixture


@dataclass
class Mixture:
    """Built records (in their final order) and the report."""

    records: list[dict[str, Any]]
    report: MixtureReport


def _source_items(src: SourceSpec, seed: int, report: SourceReport, index: EvalIndex,
                  math_workers: int | None) -> Generator[tuple[int, Messages], None, None]:
    if src.kind == "sharegpt":
        return iter_sharegpt(src, report)
    if src.kind == "math":
        return iter_math(src, seed, report, math_workers)
    if src.kind == "chitchat":
        return iter_chitchat(src, report)
    if src.kind == "code":
        return iter_code(src, seed, report, index.humaneval_names, workers=math_workers or 1)
    if src.kind == "evals":
        return iter_evals(src, seed, report)
    return iter_chat_file(src, report)


def prompt_key(messages: Messages) -> bytes:
    """Digest of the normalized system and user turns (what `dedupe` compares)."""
    text = "\x00".join(f"{m['role']}:{normalize(m['content'])}" for m in messages if m["role"] != "assistant")
    return hashlib.sha1(text.encode("utf-8")).digest()


def build_mixture(spec: MixtureSpec, *, eval_index: EvalIndex | None = None,
                  log: Callable[[str], None] | None = None, math_workers: int | None = None) -> Mixture:
    """Build the records of `spec` (module docstring) and their report.

    `eval_index` defaults to `EvalIndex.load()` (MT-Bench, HumanEval, held-out ShareGPT); `log` gets
    one line per finished source; `math_workers`: math generator processes instead of the spec's, and
    processes that parse the code source's packages (else one) — a machine's setting: the records, the
    spec and its build hash are the same at any count.
    Raises FileNotFoundError naming the install command when a source's package (or an eval
    package the leak check needs) is missing, ValueError for an option that selects nothing.
    """
    t0 = time.perf_counter()
    index = eval_index or EvalIndex.load()
    check, check_s = LeakCheck.start(index), 0.0
    seen: set[bytes] = set()
    kept: list[list[dict[str, Any]]] = []
    reports = []
    for src in spec.sources:
        t = time.perf_counter()
        report = SourceReport(name=src.name, kind=src.kind, licence=source_licence(src.name), count=src.count)
        records: list[dict[str, Any]] = []
        items = _source_items(src, spec.seed, report, index, math_workers)
        try:
            for n, messages in items:
                record = make_record(src.name, n, messages)
                problem = convention_problem(messages)
                if problem:
                    report.skip(problem, record["id"])
                    continue
                t_check = time.perf_counter()
                kept_messages = check.apply(index, record["id"], src.name, messages)
                check_s += time.perf_counter() - t_check
                if kept_messages is None:
                    report.skip("eval_leak", record["id"])
                    continue
                messages = record["messages"] = kept_messages
                key = prompt_key(messages)
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
                           eval_leak_check=check, eval_leak_check_seconds=round(check_s, 2),
                           seconds=round(time.perf_counter() - t0, 2),
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
    lines.append(f"total: {report.records} records, {report.user_turns} user turns in {report.seconds:.0f} s")
    lines.append(report.eval_leak_check.summary(report.eval_leak_check_seconds))
    return lines
