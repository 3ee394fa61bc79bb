"""The counts of a regeneration (`OUT.report.json`) and the joining of a continued one.

`regenerate` writes one `RegenerateReport` per output (data/regenerate.py). A run that its time
budget stopped can be continued into a second output from its `next_record`
(`regenerate --first-record`); `append_continuation` then appends the second output to the first
and merges the two reports, so the pair (data, report) again describes one regeneration of the
input, and its `next_record` says where a further continuation starts. `regenerate_partial_path`
names the resume file of an unfinished output.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash_trainer.data.chat import skip_summary
from dflash_trainer.decoding.gen_counts import GenerationCounts, ratios

NUM_EXAMPLES = 5


@dataclass
class RegenerateReport:
    """Counts of one regeneration (written as OUT.report.json); generated_tokens / wall_s /
    tokens_per_s cover this invocation only (not records resumed from the partial file)."""

    records_read: int = 0
    records_written: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    regenerated_turns: int = 0
    truncated_turns: int = 0
    truncated_records: int = 0
    cut_records: int = 0
    cut_turns: int = 0
    budget_cut_records: int = 0  # of cut_records: ended after their current turn when max_seconds ran out
    looped_turns: int = 0
    looped_records: int = 0
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> records, turns, looped turns
    examples: dict[str, list[int]] = field(default_factory=dict)
    output: str = ""
    output_format: str = ""
    generated_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    stopped_at_max_seconds: bool = False  # records after the last one taken were not read
    stopped_at_heldout: bool = False  # the packaged ShareGPT file: reading stopped at its held-out tail
    first_record: int = 0  # the input's records before this index were not read (--first-record)
    next_record: int | None = None  # max_seconds stopped the run: --first-record that continues it into a new output
    # the continuous generator's counts (decoding/gen_counts.py; {} for HF generate or a wave responder)
    # and the ratios drawn from them: occupancy, span efficiency, mean span, queue waits
    generator: dict[str, Any] = field(default_factory=dict)
    generator_ratios: dict[str, float] = field(default_factory=dict)
    # how the decode steps ran: {"row_attention": bool, "overlap": bool} (data/responders.py; {} for others);
    # a continuation's merged report says "mixed" for a mode its parts ran differently
    decode_modes: dict[str, Any] = field(default_factory=dict)

    def count_entries(self, entries: dict[int, dict[str, Any]]) -> list[Any]:
        """Fill the per-record counts from the finished entries {key: entry} (status ok with the
        regenerated record and its turn counts, or failed with a reason); returns the kept records
        in key order."""
        failed: Counter[str] = Counter()
        kept = []
        for index in sorted(entries):
            e = entries[index]
            if e["status"] != "ok":
                failed[e["reason"]] += 1
                self._example(e["reason"], index)
                continue
            kept.append(e["record"])
            self.regenerated_turns += e["regenerated"]
            self.truncated_turns += e["truncated"]
            self.cut_turns += e.get("cut_turns", 0)
            self.cut_records += bool(e.get("cut_turns", 0))
            self.budget_cut_records += bool(e.get("budget_cut"))
            self.looped_turns += e.get("looped", 0)
            self.looped_records += bool(e.get("looped", 0))
            src = self.by_source.setdefault(e.get("source") or "(none)", {"records": 0, "turns": 0, "looped_turns": 0})
            src["records"] += 1
            src["turns"] += e["regenerated"]
            src["looped_turns"] += e.get("looped", 0)
            if e["truncated"]:
                self.truncated_records += 1
                self._example("truncated", index)
        self.failed_by_reason = dict(failed)
        self.records_written = len(kept)
        return kept

    def skipped_line(self, unit: str = "line") -> str | None:
        """One line on the input records the trainer cannot use (skipped, not answered) by reason, with what
        each reason asks and the first records' numbers counted from 1 (`unit`: "line" of a JSONL file,
        "record" of a JSON array); None when none was skipped."""
        if not self.skipped_by_reason:
            return None
        n = sum(self.skipped_by_reason.values())
        refs = {r: [f"{unit} {i + 1}" for i in self.examples.get(r, [])] for r in self.skipped_by_reason}
        return (f"{n} of {self.records_read} input records skipped, not answered: "
                f"{skip_summary(self.skipped_by_reason, refs)}")

    def _example(self, reason: str, index: int) -> None:
        ex = self.examples.setdefault(reason, [])
        if len(ex) < NUM_EXAMPLES:
            ex.append(index)


def combine(first: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """One report for an output followed by its continuation (`more` read from `first`'s
    next_record on): counts and times summed, per-reason and per-source counts merged, examples
    kept up to NUM_EXAMPLES; first_record from `first`, where it stopped (stopped_at_*,
    next_record) from `more`. Reports from before a field existed count it as its default.
    Raises ValueError when `first` was not stopped by its budget or `more` does not start at its
    next_record (then the two are not one regeneration)."""
    start = first.get("next_record") or first.get("first_record", 0) + first["records_read"]
    if not first.get("stopped_at_max_seconds"):
        raise ValueError(f"{first.get('output')}: read its whole input (not stopped by max_seconds); nothing continues it")
    if more.get("first_record", 0) != start:
        raise ValueError(f"{more.get('output')} starts at record {more.get('first_record', 0)}, but "
                         f"{first.get('output')} stopped before record {start}; regenerate with --first-record {start}")
    out: dict[str, Any] = {}
    for f in fields(RegenerateReport):
        a, b = first.get(f.name, _default(f)), more.get(f.name, _default(f))
        if f.name in ("output", "output_format", "first_record"):
            out[f.name] = a
        elif f.name == "decode_modes":  # a mode both parts ran as they did; "mixed" where they differ
            out[f.name] = {k: a[k] if a.get(k) == b.get(k) else "mixed" for k in {**a, **b}} if a and b else b or a
        elif f.name in ("stopped_at_max_seconds", "stopped_at_heldout", "next_record"):
            out[f.name] = b
        elif f.name == "by_source":
            out[f.name] = {s: dict(Counter(a.get(s, {})) + Counter(b.get(s, {}))) for s in {**a, **b}}
        elif f.name == "examples":
            out[f.name] = {r: (a.get(r, []) + b.get(r, []))[:NUM_EXAMPLES] for r in {**a, **b}}
        elif f.name == "generator":
            out[f.name] = add_counts(a, b)
        elif f.name == "generator_ratios":
            continue  # drawn from the summed counts below
        elif isinstance(a, dict):
            out[f.name] = dict(Counter(a) + Counter(b))
        else:
            out[f.name] = a + b
    out["tokens_per_s"] = out["generated_tokens"] / max(out["wall_s"], 1e-9)
    out["generator_ratios"] = ratios(out["generator"])
    return out


def add_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two `GenerationCounts.as_dict()` summed key by key (nested histograms too; keys of either), in
    `as_dict`'s order; {} and {} give {}."""
    out: dict[str, Any] = {}
    for k in {**a, **b}:
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) or isinstance(y, dict):
            out[k] = add_counts(x or {}, y or {})
        else:
            out[k] = (x or 0) + (y or 0)
    if out and set(out) <= {f.name for f in fields(GenerationCounts)}:
        out = GenerationCounts(**out).as_dict()
    return out


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def append_continuation(out: str | Path, more: str | Path) -> dict[str, Any]:
    """Append the JSONL output `more` (a continuation of `out`, regenerated with --first-record =
    out's next_record) to `out` and rewrite OUT.report.json as `combine` of the two reports; returns
    the combined report. The data is replaced before the report, each atomically. Raises
    ValueError for JSON-array outputs (append JSONL only) and as `combine` does."""
    out, more = Path(out), Path(more)
    if out.suffix.lower() != ".jsonl" or more.suffix.lower() != ".jsonl":
        raise ValueError(f"{out} / {more}: only JSONL outputs are appended; regenerate into .jsonl files")
    report_path = out.with_name(out.name + ".report.json")
    merged = combine(json.loads(report_path.read_text()),
                     json.loads(more.with_name(more.name + ".report.json").read_text()))
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    write_atomic(out, data + more.read_bytes())
    write_atomic(report_path, json.dumps(merged, indent=2) + "\n")
    return merged


def regenerate_partial_path(out: str | Path) -> Path:
    """`regenerate`'s resume file for output `out`: OUT.partial.jsonl (it exists while OUT is unfinished)."""
    out = Path(out)
    return out.with_name(out.name + ".partial.jsonl")


def write_report(path: Path, report: RegenerateReport) -> None:
    """OUT.report.json for the output `path`, written atomically."""
    write_atomic(path.with_name(path.name + ".report.json"), json.dumps(asdict(report), indent=2) + "\n")


def write_atomic(path: Path, content: str | bytes) -> None:
    """Write `content` to a temporary file beside `path`, fsync it, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(content.encode("utf-8") if isinstance(content, str) else content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
