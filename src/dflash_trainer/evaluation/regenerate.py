"""`dflash-train regenerate`: replace the assistant turns of a chat file with the target's own.

The DFlash recipe trains on responses the target itself generates (with the serving template
and thinking flag), so the drafter learns the distribution it will be asked to predict.

What changes and what does not:
  * Every record keeps its structure, keys and order; only the content of assistant turns is
    replaced (`value` in ShareGPT turns, `content` in OpenAI-style messages). System and user
    turns, ids and any other fields are copied untouched (byte-identical strings).
  * Assistant turn i is generated from the conversation before it, with the earlier assistant
    turns already regenerated. Assistant turns before the first user turn (nothing to answer)
    are left as they are, as are turns after the last assistant turn.
  * Records the trainer could not use (data/chat.py reasons) are not written; they are counted
    by reason. A record whose generation fails (prompt too long, empty response) is not written
    and counted by reason. Responses cut by `max_new_tokens` are kept and counted as truncated.
  * The output has the input's format: a JSON array for a JSON-array input, JSONL for JSONL.

Batching: records are processed in chunks of `batch_size`; within a chunk, the next pending
assistant turn of every record is generated together (left-padded batched generation), until all
turns are done. Greedy at temperature 0, else sampling; each chunk reseeds from (seed, first record
index) so a resumed run regenerates a chunk the same way.

Resume: finished chunks are appended to `OUT.partial.jsonl` (first line: the settings). Running
the same command again skips the records already there (a half-written last line is dropped);
different settings are refused. When the input is exhausted the output file is written
atomically, `OUT.report.json` holds the counts, and the partial file is removed.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from dflash_trainer.data.chat import ROLE_MAP, ReadStats, iter_records, normalize_record
from dflash_trainer.evaluation.chat import eos_token_ids, render_prompt
from dflash_trainer.target.load import TargetBundle

NUM_EXAMPLES = 5


@dataclass
class Response:
    """One generated assistant turn: text, whether it ended with an end-of-sequence token, and an
    error reason (then the record is counted as failed)."""

    text: str
    finished: bool = True
    error: str | None = None


Responder = Callable[[list[list[dict[str, str]]], int], list[Response]]
"""(conversations ending with a user turn, seed) -> one Response each."""


@dataclass
class RegenerateSettings:
    """What `dflash-train regenerate` runs (also written to the partial file to check a resume)."""

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

    def resume_key(self) -> dict[str, Any]:
        """The settings that change the output (a resume must match them)."""
        d = asdict(self)
        d.pop("max_conversations")
        d.pop("batch_size")
        return d


@dataclass
class RegenerateReport:
    """Counts of one regeneration (written as OUT.report.json)."""

    records_read: int = 0
    records_written: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    regenerated_turns: int = 0
    truncated_turns: int = 0
    truncated_records: int = 0
    examples: dict[str, list[int]] = field(default_factory=dict)
    output: str = ""
    output_format: str = ""


class _Record:
    """A record being regenerated: its copy, the turn list, and the cursor over its turns."""

    def __init__(self, index: int, record: dict[str, Any]):
        self.index = index
        self.record = copy.deepcopy(record)
        self.turns: list[dict[str, Any]] = self.record["conversations" if "conversations" in record else "messages"]
        self.context: list[dict[str, str]] = []
        self.cursor = 0
        self.waiting: int | None = None  # turn index whose response is being generated
        self.regenerated = 0
        self.truncated = 0
        self.error: str | None = None

    def next_prompt(self) -> list[dict[str, str]] | None:
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
        if response.error or not response.text.strip():
            self.error = response.error or "empty_response"
            self.cursor = len(self.turns)
            return
        turn = self.turns[self.waiting]
        turn["value" if "value" in turn else "content"] = response.text
        self.context.append({"role": "assistant", "content": response.text})
        self.regenerated += 1
        self.truncated += not response.finished
        self.waiting = None


def regenerate_chunk(records: Sequence[tuple[int, dict[str, Any]]], respond: Responder, seed: int) -> list[dict[str, Any]]:
    """Regenerate the assistant turns of a chunk of usable records (batched across records).

    Returns one partial-file entry per record: {index, status ok|failed, reason, regenerated,
    truncated, record (when ok)}.
    """
    items = [_Record(i, r) for i, r in records]
    pending = {id(it): it.next_prompt() for it in items}
    while True:
        active = [it for it in items if it.error is None and pending[id(it)] is not None]
        if not active:
            break
        responses = respond([pending[id(it)] for it in active], seed)
        if len(responses) != len(active):
            raise RuntimeError(f"responder returned {len(responses)} responses for {len(active)} prompts")
        for it, resp in zip(active, responses):
            it.answer(resp)
            pending[id(it)] = None if it.error else it.next_prompt()
    out = []
    for it in items:
        entry: dict[str, Any] = {"index": it.index, "status": "failed" if it.error else "ok", "reason": it.error,
                                 "regenerated": it.regenerated, "truncated": it.truncated}
        if not it.error:
            entry["record"] = it.record
        out.append(entry)
    return out


def _input_is_json_array(path: Path) -> bool:
    """The same rule as data/chat.py's reader: starts with '[' and is not named .jsonl."""
    with path.open("r", encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return head[:1] == "[" and path.suffix.lower() != ".jsonl"


def _read_partial(path: Path, key: dict[str, Any]) -> list[dict[str, Any]]:
    """Entries of an existing partial file (dropping a half-written last line); [] if absent.
    Raises ValueError when it was written with other settings."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    good = raw[: raw.rfind(b"\n") + 1]  # a crash can leave a partial last line
    lines = good.decode("utf-8").splitlines()
    if not lines:
        path.unlink()
        return []
    header = json.loads(lines[0])
    if header.get("settings") != key:
        raise ValueError(f"{path} was written with other settings ({header.get('settings')}); rerun with those "
                         "settings to resume, or delete it to start over")
    if len(good) != len(raw):
        with path.open("r+b") as f:
            f.truncate(len(good))
    return [json.loads(ln) for ln in lines[1:]]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def regenerate_file(settings: RegenerateSettings, respond: Responder, console: Console | None = None) -> RegenerateReport:
    """Regenerate `settings.data` into `settings.out` with `respond` (see the module docstring).

    Raises ValueError when OUT exists without a partial file (a finished output is never
    overwritten silently) or when a partial file has other settings.
    """
    console = console or Console(quiet=True)
    data, out = Path(settings.data), Path(settings.out)
    if not data.is_file():
        raise FileNotFoundError(f"--data {data}: file not found")
    if settings.batch_size < 1:
        raise ValueError(f"batch_size={settings.batch_size} must be >= 1")
    partial = out.with_name(out.name + ".partial.jsonl")
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
    usable = len(entries)  # usable records handled so far (skipped ones are not stored)
    chunk: list[tuple[int, dict[str, Any]]] = []

    def flush() -> None:
        if not chunk:
            return
        done = regenerate_chunk(chunk, respond, seed=settings.seed * 1_000_003 + chunk[0][0])
        with partial.open("a", encoding="utf-8") as f:
            for e in done:
                f.write(json.dumps(e, ensure_ascii=False) + "\n")
                entries[e["index"]] = e
            f.flush()
            os.fsync(f.fileno())
        console.print(f"  {len(entries)} records done")
        chunk.clear()

    for index, record in iter_records(data, stats):
        if index in entries:  # done in an earlier run (ok or failed)
            stats.read += 1
            continue
        if settings.max_conversations and usable >= settings.max_conversations:
            break
        stats.read += 1
        try:
            normalize_record(record)
        except Exception as e:  # data/chat.py signals an unusable record with a reason
            reason = getattr(e, "reason", type(e).__name__)
            skipped[reason] += 1
            ex = examples.setdefault(reason, [])
            if len(ex) < NUM_EXAMPLES:
                ex.append(index)
            continue
        usable += 1
        chunk.append((index, record))
        if len(chunk) >= settings.batch_size:
            flush()
    flush()

    report = RegenerateReport(records_read=stats.read, output=str(out),
                              output_format="json" if _input_is_json_array(data) else "jsonl")
    skipped.update(stats.skipped)  # unreadable lines / truncated tail counted by the reader
    report.skipped_by_reason = dict(skipped)
    failed: Counter[str] = Counter()
    kept = []
    for index in sorted(entries):
        e = entries[index]
        if e["status"] == "ok":
            kept.append(e["record"])
            report.regenerated_turns += e["regenerated"]
            report.truncated_turns += e["truncated"]
            if e["truncated"]:
                report.truncated_records += 1
                ex = examples.setdefault("truncated", [])
                if len(ex) < NUM_EXAMPLES:
                    ex.append(index)
        else:
            failed[e["reason"]] += 1
            ex = examples.setdefault(e["reason"], [])
            if len(ex) < NUM_EXAMPLES:
                ex.append(index)
    report.failed_by_reason = dict(failed)
    report.records_written = len(kept)
    report.examples = examples
    if report.output_format == "json":
        _write_atomic(out, json.dumps(kept, ensure_ascii=False, indent=1) + "\n")
    else:
        _write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    _write_atomic(out.with_name(out.name + ".report.json"), json.dumps(asdict(report), indent=2) + "\n")
    partial.unlink()
    return report


class TargetResponder:
    """Batched generation with the target: render each conversation with the chat template and
    the generation prompt, left-pad, `generate`, cut at the first end-of-sequence token, decode.

    temperature 0 = greedy; > 0 = plain sampling at that temperature (no top-k / top-p).
    A prompt that leaves fewer than max_new_tokens positions gets Response(error="prompt_too_long").
    """

    def __init__(self, target: TargetBundle, chat_template: str, *, max_new_tokens: int, temperature: float = 0.0,
                 enable_thinking: bool | None = None):
        if target.tokenizer is None:
            raise ValueError(f"target {target.name_or_path} has no tokenizer; regeneration renders chat prompts")
        self.target = target
        self.tokenizer = target.tokenizer
        self.chat_template = chat_template
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.enable_thinking = enable_thinking
        self.eos = eos_token_ids(target)
        if not self.eos:
            raise ValueError(f"target {target.name_or_path}: no end-of-sequence token id in tokenizer or config")
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else min(self.eos)
        self.max_positions = int(getattr(target.config, "max_position_embeddings", 1 << 30) or (1 << 30))

    @torch.no_grad()
    def __call__(self, conversations: list[list[dict[str, str]]], seed: int) -> list[Response]:
        from transformers import GenerationConfig

        prompts = [render_prompt(self.tokenizer, self.chat_template, c, self.enable_thinking) for c in conversations]
        ok = [i for i, p in enumerate(prompts) if len(p) + self.max_new_tokens <= self.max_positions]
        results = [Response(text="", finished=False, error="prompt_too_long") for _ in prompts]
        if not ok:
            return results
        device = self.target.embed_tokens.weight.device
        width = max(len(prompts[i]) for i in ok)
        ids = torch.full((len(ok), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ok), width), dtype=torch.long)
        for r, i in enumerate(ok):  # left padding: every prompt ends at the last column
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        sample = self.temperature > 0
        # When sampling, every knob is set explicitly: values left None are filled from the model's
        # generation config and then from transformers' defaults (top_k=50).
        knobs = dict(temperature=self.temperature, top_k=0, top_p=1.0) if sample else {}
        gc = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=sample, repetition_penalty=1.0,
                              eos_token_id=sorted(self.eos), pad_token_id=self.pad_id, **knobs)
        torch.manual_seed(seed)
        out = self.target.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gc)
        new = out[:, width:].tolist()  # host sync: the tokens are decoded on the host
        for r, i in enumerate(ok):
            toks = new[r]
            end = next((j for j, t in enumerate(toks) if t in self.eos), None)
            body = toks if end is None else toks[:end]
            results[i] = Response(text=self.tokenizer.decode(body, skip_special_tokens=True), finished=end is not None)
        return results

