"""`dflash-train regenerate`: replace the assistant turns of a chat file with the target's own.

The DFlash recipe trains on responses the target itself generates (with the serving template
and thinking flag), so the drafter learns the distribution it will be asked to predict.

What changes and what does not:
  * Every record keeps its structure, keys and order; only the content of assistant turns is
    replaced (`value` in ShareGPT turns, `content` in OpenAI-style messages). System and user
    turns, ids and any other fields are copied untouched (byte-identical strings).
  * Assistant turn i is generated from the conversation before it, with the earlier assistant
    turns already regenerated (multi-turn: the target's own earlier answers are its context),
    rendered by data/render.py `render_prompt`: the served prompt that turn's training
    document holds (data/serving.py), token for token.
    Assistant turns before the first user turn (nothing to answer) are left as they are.
  * Prompt-only records: a user turn that no assistant turn follows (the next turn is another
    user turn, or the record ends) gets a new assistant turn after it, written in the record's
    own turn format (`{"from": "gpt", "value"}` or `{"role": "assistant", "content"}`). So a
    file of user turns alone (data/mixture's prompt sources) is answered turn by turn.
  * The packaged ShareGPT file is read only up to its held-out tail (data/sources.py; the report
    says `stopped_at_heldout`).
  * Records the trainer could not use (data/chat.py reasons) are not written; they are counted
    by reason. A record whose generation fails (prompt too long, empty response) is not written
    and counted by reason. Responses cut by `max_new_tokens` are kept, counted as truncated and
    marked on their turn with `"truncated": true` (readers ignore the key; `benchmarks/` uses it
    to compare data with and without unfinished answers).
  * Loop guard (`loop_ngram`): a turn whose last loop_ngram tokens repeat an earlier stretch of
    the same turn is stopped (checked every few decode steps, so the repetition is kept once plus
    at most that many tokens; generation stops, which saves the rest of the budget), marked
    `"looped": true` and counted as looped (not as truncated).
  * Several samples per prompt (`samples` > 1, temperature > 0): each record is regenerated
    `samples` times with independent draws; each copy is written with `"sample": s`, and a record
    without a string or integer `id` gets `"id": "input-<index>"` (its 0-based index in the input),
    so that the copies share one id and prepare keeps them in one split (data/prepare.py
    `validation_set`).
  * Records with a `source` field (data/mixture) are counted per source in the report.
  * The output is JSONL when its name ends in .jsonl, one JSON array when it ends in .json, else
    in the input's format (the reader tells the two apart by the same name).

Batching: up to `batch_size` × `lookahead` records are in flight at once (a quarter of
`batch_size` more when the responder overlaps its polls with the device's steps, `--overlap`: a
turn submitted after a poll starts one poll later, so some must wait for the rows freed
meanwhile); each has at most one turn being generated or waiting, and when a turn finishes the
record's next turn is submitted at once. With lookahead > 1 more turns wait than there are rows,
and the target responder starts the shortest waiting prompts first (short attended spans; the
longest prompts run last). The target responder runs continuous batching
(decoding/continuous.py): one cache row per in-flight turn, rows refilled as turns finish, so
the GPU never waits for the longest response of a batch. Greedy at
temperature 0 (in fp32 the output does not depend on the batch size; in bf16 another batch shape
can flip a near-tie), else sampling with one generator
seeded from `seed` (then a resumed or differently batched run samples differently).

Long conversations: a turn whose prompt exceeds `max_prompt_tokens` ends the record there. If an
earlier turn was regenerated, the record is written cut after the last regenerated assistant
turn (counted as `cut_records` / `cut_turns`); otherwise it fails as `prompt_too_long`.
`drop_truncated` treats a response cut by `max_new_tokens` or stopped by the loop guard the same
way (reason `truncated`): the data keeps only answers the target finished.

Resume: every finished record is appended to `OUT.partial.jsonl` (first line: the settings).
Running the same command again skips the records already there (a half-written last line is
dropped); different settings are refused. At the end the output file is written atomically and
`OUT.report.json` holds the counts. When the input is exhausted the partial file is removed; when
`max_seconds` stopped the run (no new record is taken; each record in flight ends after its current
turn, written cut after its last regenerated answer and counted as `budget_cut_records`, so the run
overshoots its budget by one turn, not by a whole multi-turn conversation) the output holds the
records done so far and the partial file stays, so the same command continues where it stopped
(with the records not yet read and the budget-cut ones, which are answered again in full).

Continuing in a new output (the partial file is gone, e.g. the output was brought back from another
machine): a run stopped by `max_seconds` reports `next_record`, the index after the last record it
took; `first_record` = that index makes a new run skip the records before it (not read, not
counted; they still count toward the packaged ShareGPT file's held-out limit) and answer the rest.
The two outputs together are the whole input's regeneration (records cut by the first run's budget
stay cut). With `samples` > 1 a record's samples are taken together, even past the budget.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from dflash_trainer.data.chat import ReadStats, RecordSkipped, iter_records, normalize_record
from dflash_trainer.data.regen_report import (NUM_EXAMPLES, RegenerateReport, regenerate_partial_path, write_atomic,
                                              write_report)
from dflash_trainer.data.regen_turns import RecordInProgress, with_answer_slots
from dflash_trainer.data.sources import training_conversation_limit
from dflash_trainer.data.responders import Conversation, Responder, Response, WaveResponder
from dflash_trainer.decoding.gen_counts import ratios

# Settings added after partial files were first written, with the value those files implied.
_NEWER_SETTINGS = {"max_prompt_tokens": 2048, "drop_truncated": False, "top_p": 1.0, "loop_ngram": None, "samples": 1,
                   "first_record": 0}
_PLACEHOLDER = "(to be generated)"  # content of an inserted assistant turn while usability is checked


@dataclass
class RegenerateSettings:
    """What `dflash-train regenerate` runs (also written to the partial file to check a resume).

    batch_size: records in flight (= rows of the continuous batch). max_prompt_tokens: longest
    rendered prompt generated for (longer turns end the record, see the module docstring).
    """

    data: str
    out: str
    target: str | None = None
    max_new_tokens: int = 1024
    temperature: float = 0.0
    enable_thinking: bool | None = None
    chat_template: str | None = None
    batch_size: int = 8
    max_conversations: int | None = None
    seed: int = 0
    max_prompt_tokens: int = 2048
    max_seconds: float | None = None  # stop taking new records after this long (in-flight ones end after their turn)
    drop_truncated: bool = False  # a turn cut by max_new_tokens (or the loop guard) ends its record before that turn
    top_p: float = 1.0  # nucleus of the sampling (temperature > 0)
    loop_ngram: int | None = None  # loop guard: stop a turn whose last n tokens occurred earlier in it
    samples: int = 1  # regenerations of each record (temperature > 0)
    lookahead: int = 1  # records in flight per cache row (> 1: the responder starts the shortest prompts first)
    first_record: int = 0  # records of `data` before this index are not read (an earlier run's `next_record`)

    def check(self) -> None:
        """Raise ValueError naming the setting when the settings cannot run together."""
        if self.first_record < 0:
            raise ValueError(f"first_record={self.first_record}: must be >= 0 (an index of the input's records)")
        if self.lookahead < 1:
            raise ValueError(f"lookahead={self.lookahead}: must be >= 1 (records in flight per cache row)")
        if self.samples < 1:
            raise ValueError(f"samples={self.samples}: must be >= 1")
        if self.samples > 1 and self.temperature <= 0:
            raise ValueError(f"samples={self.samples} with temperature 0 would write the same greedy answer "
                             f"{self.samples} times; set --temperature > 0 or --samples 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.loop_ngram is not None and self.loop_ngram < 1:
            raise ValueError(f"loop_ngram={self.loop_ngram}: must be >= 1 (or unset: no loop guard)")

    def resume_key(self) -> dict[str, Any]:
        """The settings that change the output (a resume must match them)."""
        d = asdict(self)
        for k in ("max_conversations", "batch_size", "max_seconds", "lookahead"):
            d.pop(k)
        return d


def input_is_json_array(path: Path) -> bool:
    """The same rule as data/chat.py's reader: starts with '[' and is not named .jsonl."""
    with path.open("r", encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return head[:1] == "[" and path.suffix.lower() != ".jsonl"


def output_format(data: Path, out: Path) -> str:
    """"jsonl" or "json" (one array): what the output's name says (.jsonl / .json), else the input's
    format. The reader decides by the same name (a .jsonl file is read line by line), so an array
    written to a .jsonl name would not read back."""
    suffix = out.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return suffix[1:]
    return "json" if input_is_json_array(data) else "jsonl"


def _read_partial(path: Path, key: dict[str, Any]) -> list[dict[str, Any]]:
    """Entries of an existing partial file (dropping a half-written last line); [] if absent.
    Raises ValueError when it was written with other settings."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    good = raw[: raw.rfind(b"\n") + 1]  # a crash can leave a partial last line
    # JSON lines end at "\n" only: splitlines() would also break at U+2028, U+2029 or NEL inside an answer
    lines = [ln for ln in good.decode("utf-8").split("\n") if ln]
    if not lines:
        path.unlink()
        return []
    header = json.loads(lines[0])
    saved = {**_NEWER_SETTINGS, **(header.get("settings") or {})}  # files from before a setting existed
    if saved != key:
        raise ValueError(f"{path} was written with other settings ({header.get('settings')}); rerun with those "
                         "settings to resume, or delete it to start over")
    if len(good) != len(raw):
        with path.open("r+b") as f:
            f.truncate(len(good))
    return [json.loads(ln) for ln in lines[1:]]


def _usable_records(settings: RegenerateSettings, done: dict[int, Any], stats: ReadStats, skipped: Counter[str],
                    examples: dict[str, list[int]], reached: dict[str, bool]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(key, record) still to regenerate, in file order: key = record index · samples + sample;
    not in `done`, usable by the trainer once every user turn has an answer slot (others counted
    in `skipped` by reason), at most max_conversations usable records in all; on the packaged
    ShareGPT file, none from its held-out tail (then reached["heldout"] is set)."""
    n = settings.samples
    usable = len({k // n for k in done})
    limit = training_conversation_limit(settings.data)  # the packaged ShareGPT file: never its held-out tail
    conversations = 0  # usable as they stand (the held-out rule's count)
    seen = 0  # records (lines) of the input so far
    # lines before first_record are skipped unparsed, unless the held-out rule must count them
    start = settings.first_record if limit is None else 0
    for index, record in iter_records(Path(settings.data), stats, start=start):
        seen = index + 1
        if limit is not None:
            try:
                normalize_record(record)
                conversations += 1
            except RecordSkipped:
                pass
            if conversations > limit:
                reached["heldout"] = True
                return
        if index < settings.first_record:  # read by an earlier run (its report's next_record)
            continue
        stats.read += 1
        keys = [index * n + s for s in range(n)]
        if all(k in done for k in keys):  # done in an earlier run (ok or failed)
            continue
        if settings.max_conversations and usable >= settings.max_conversations:
            stats.read -= 1
            return
        try:
            normalize_record(with_answer_slots(record, _PLACEHOLDER))
        except Exception as e:  # data/chat.py signals an unusable record with a reason
            reason = getattr(e, "reason", type(e).__name__)
            skipped[reason] += 1
            ex = examples.setdefault(reason, [])
            if len(ex) < NUM_EXAMPLES:
                ex.append(index)
            continue
        if not any(k in done for k in keys):
            usable += 1
        slotted = with_answer_slots(record)
        # one id for the samples of a prompt (prepare splits by id); the chat reader's rule: ids other than
        # str / int fall back to the record's output position, which differs per sample
        if n > 1 and not isinstance(slotted.get("id"), (str, int)):
            slotted = {**slotted, "id": f"input-{index}"}
        for s, k in enumerate(keys):
            if k not in done:
                yield k, (slotted if n == 1 else {**slotted, "sample": s})
    if settings.first_record > seen and start:  # JSONL lines before start were not yielded: count them
        with Path(settings.data).open("r", encoding="utf-8") as f:
            seen = sum(1 for _ in f)
    if settings.first_record > seen:
        raise ValueError(f"first_record={settings.first_record}: {settings.data} has only {seen} records; "
                         "pass the next_record of the run to continue (its OUT.report.json)")


def regenerate_file(settings: RegenerateSettings, respond: Responder | Callable[[list[Conversation], int], list[Response]],
                    console: Console | None = None) -> RegenerateReport:
    """Regenerate `settings.data` into `settings.out` with `respond` (see the module docstring).

    respond: a streaming Responder, or a wave function `(conversations, seed) -> responses`
    (wrapped in WaveResponder). Raises ValueError when OUT exists without a partial file (a
    finished output is never overwritten silently) or when a partial file has other settings.
    """
    console = console or Console(quiet=True)
    settings.check()
    if not hasattr(respond, "submit"):
        respond = WaveResponder(respond, settings.seed)
    data, out = Path(settings.data), Path(settings.out)
    if not data.is_file():
        raise FileNotFoundError(f"--data {data}: file not found")
    if settings.batch_size < 1:
        raise ValueError(f"batch_size={settings.batch_size} must be >= 1")
    partial = regenerate_partial_path(out)
    if out.exists() and not partial.exists():
        raise ValueError(f"--out {out} already exists; delete it or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    key = settings.resume_key()
    entries = {e["index"]: e for e in _read_partial(partial, key)}
    if entries:
        console.print(f"resuming: {len(entries)} records already done in {partial}")
    if not partial.exists():
        partial.write_text(json.dumps({"settings": key}) + "\n")

    stats = ReadStats()
    skipped: Counter[str] = Counter()
    examples: dict[str, list[int]] = {}
    reached: dict[str, bool] = {}
    # a record the time budget cut is answered again in full (its cut version stays until then)
    source = _usable_records(settings, {k: e for k, e in entries.items() if not e.get("budget_cut")}, stats, skipped,
                             examples, reached)
    flying: dict[int, RecordInProgress] = {}
    counts = getattr(respond, "generation_counts", None)  # the continuous generator's telemetry, when it has one
    t0 = time.perf_counter()
    last_report, generated = t0, 0  # the first progress line after 10 s, not at the first poll
    timed_out = False
    # past the budget, records are still taken while the last one taken has samples left (samples > 1) or lies
    # before a record a crashed run finished (its gaps): every record below next_record is then done
    open_record, last_taken = False, -1
    fill_to = max((k // settings.samples for k in entries), default=-1)

    # with an overlapping responder a turn submitted after a poll starts one poll later: a quarter of the rows
    # more records in flight keep prompts queued for the rows freed meanwhile (otherwise idle one more stretch)
    spare = settings.batch_size // 4 if getattr(respond, "overlaps", False) else 0
    max_flying = settings.batch_size * settings.lookahead + spare

    def over_budget() -> bool:
        return settings.max_seconds is not None and time.perf_counter() - t0 > settings.max_seconds

    with partial.open("a", encoding="utf-8") as f:
        while True:
            if over_budget():
                timed_out = True  # the time budget: take no new record; those in flight end after their current turn
            while ((not timed_out or open_record or last_taken < fill_to)
                   and len(flying) < max_flying):
                nxt = next(source, None)  # records in flight
                if nxt is None:
                    break
                open_record = nxt[0] % settings.samples != settings.samples - 1
                last_taken = nxt[0] // settings.samples
                rec = RecordInProgress(*nxt, drop_truncated=settings.drop_truncated)
                prompt = rec.next_prompt()
                if prompt is None:  # nothing to answer (normalize_record accepted it, so rare)
                    entries[rec.index] = rec.entry()
                    f.write(json.dumps(entries[rec.index], ensure_ascii=False) + "\n")
                    continue
                flying[rec.index] = rec
                respond.submit(rec.index, prompt)
            if not respond.busy:
                break
            finished = []
            for index, response in respond.poll():
                rec = flying[index]
                rec.answer(response)
                generated += response.num_tokens
                prompt = None if rec.error else rec.next_prompt()
                if prompt is not None and over_budget():  # end it after this answer, not after all its turns
                    rec.cut_after_last_answer()
                    prompt = None
                if prompt is None:
                    finished.append(flying.pop(index))
                else:
                    respond.submit(index, prompt)
            for rec in finished:
                entries[rec.index] = rec.entry()
                f.write(json.dumps(entries[rec.index], ensure_ascii=False) + "\n")
            if finished:
                f.flush()
                os.fsync(f.fileno())
            now = time.perf_counter()
            if now - last_report > 10:
                last_report = now
                r = ratios(counts()) if counts else {}
                rows = (f", so far {r['mean_live_rows']:,.0f} of {r['rows']:,.0f} rows live and a span of "
                        f"{r['mean_span']:,.0f} slots on average" if r else "")
                console.print(f"  {len(entries)} records done, {len(flying)} in flight, "
                              f"{generated / max(now - t0, 1e-9):,.0f} generated tok/s{rows}")
    wall = time.perf_counter() - t0

    report = RegenerateReport(records_read=stats.read, output=str(out),
                              output_format=output_format(data, out),
                              generated_tokens=generated, wall_s=wall, tokens_per_s=generated / max(wall, 1e-9),
                              stopped_at_max_seconds=timed_out,
                              stopped_at_heldout=reached.get("heldout", False), first_record=settings.first_record,
                              generator=counts() if counts else {},
                              decode_modes=dict(getattr(respond, "decode_modes", {})))
    report.generator_ratios = ratios(report.generator)
    if timed_out:  # every record up to the last one taken is done (ok, failed or cut): continue after it
        report.next_record = max([settings.first_record] + [k // settings.samples + 1 for k in entries])
    skipped.update(stats.skipped)  # unreadable lines / truncated tail counted by the reader
    for reason, refs in stats.examples.items():  # theirs are "line N …" / "record N …", counted from 1
        examples.setdefault(reason, [int(ref.split()[1]) - 1 for ref in refs])
    report.skipped_by_reason = dict(skipped)
    report.examples = examples
    kept = report.count_entries(entries)
    if report.output_format == "json":
        write_atomic(out, json.dumps(kept, ensure_ascii=False, indent=1) + "\n")
    else:
        write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    write_report(out, report)
    if not timed_out:  # a time-boxed run keeps its partial file: the same command continues it
        partial.unlink()
    return report
