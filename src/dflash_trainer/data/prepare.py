"""`dflash-train prepare`: chat file → train/validation packed rows + prepare_report.json.

Flow: read and normalize (chat.py) → render with the target's template, every assistant turn as
served, and mask all but assistant tokens (per_turn.py) → split conversations into train/validation
by a seeded shuffle (before packing, so no conversation reaches both; records sharing an id, such as a
prompt's regenerated samples, split together: `validation_set`) → pack each split into rows of
T tokens (pack.py) → `datasets` Arrow folders `train/` and `validation/` with columns

  input_ids     list[int32] (T)
  loss_mask     list[int8]  (T)   1 = assistant token
  position_ids  list[int32] (T)   0 at each document start; padding is one last pseudo-document

Every conversation read is accounted for: `conversations_read == conversations_kept +
conversations_skipped`, with the skips broken down by reason. A kept conversation is one document,
or one per assistant turn where its single render differs from what serving shows (per_turn.py;
counted as `expanded_per_turn` conversations that gave `expanded_per_turn_documents` documents);
train and validation are split by conversation either way. The output is a pure function of (data
file, tokenizer, template, settings): the same inputs give the same bytes.

On the packaged ShareGPT file, reading stops before its held-out tail and the parts of the
conversation the tail starts in (data/sources.py; reported as `heldout_start`, `training_end`,
`stopped_at_heldout`). Every user turn is checked against the eval prompts (MT-Bench, HumanEval,
held-out ShareGPT; data/mixture/leaks.py): a conversation is cut before its first leaking user turn,
or skipped as `eval_leak` when that is its first; `eval_leak_check` in the report counts both. Records of a prompt mixture carry a `source` field
(data/mixture); the report then counts conversations per source and split, with each licence.
With a mixture spec's weights (`weights`, data/mixture/weights.py) each conversation enters the rows
0, 1, 2 … times by its source, its copies in one split; the report's `spec` holds the counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dflash_trainer.data.chat import Conversation, ReadStats, iter_conversations
from dflash_trainer.data.mixture.leaks import EvalIndex, LeakCheck
from dflash_trainer.data.mixture.weights import SourceWeights
from dflash_trainer.data.pack import LongDocuments, pack_documents
from dflash_trainer.data.prepare_report import REPORT_NAME, PrepareReport, SourceConversations
from dflash_trainer.data.sources import (is_packaged_sharegpt, recorded_data_path, sharegpt_heldout_start,
                                         training_conversation_limit)
from dflash_trainer.data.tokenize import chat_template_sha256, resolve_chat_template
from dflash_trainer.data.tokenize_pool import tokenized_in_order
from dflash_trainer.target_model.paths import recorded_target
from dflash_trainer.target_model.tokenizer_check import tokenizer_fingerprint

SPLITS = ("train", "validation")
_FORMAT_FIX = "check the file format (ShareGPT or OpenAI messages)"
# What to do when every conversation is skipped, by the most common reason (others: _FORMAT_FIX).
SKIP_FIXES = {
    "template_without_generation_prompt": "the chat template writes nothing for add_generation_prompt, so no "
                                          "assistant turn can be served: pass --chat-template with the template "
                                          "serving uses",
    "template_error": "the chat template raises on these conversations: pass --chat-template with one that "
                      "renders them",
    "reasoning_with_thinking_disabled": "the answers reason but enable_thinking is false: set enable_thinking "
                                        "true (or leave it unset), as the data was written",
}


class _Doc(NamedTuple):
    id: str  # the conversation's id (the validation split's key)
    input_ids: np.ndarray  # int32 [len]
    loss_mask: np.ndarray  # int8 [len]
    ref: str = ""  # how a message names the conversation (Conversation.where: `line 4 id=x`, else its id)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _transformers_version() -> str:
    """The installed transformers release (the report's `transformers_version`)."""
    import transformers

    return transformers.__version__


def tokenizer_name(tokenizer: Any) -> str:
    """What the tokenizer was read from: its folder, or its GGUF file (folder/file), else its class name."""
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    gguf = getattr(tokenizer, "init_kwargs", {}).get("gguf_file")
    return f"{name}/{gguf}" if gguf and Path(name).name != gguf else name


def split_counts(num: int, validation_fraction: float) -> int:
    """Validation conversations out of `num`: round(num·fraction), at least 1 when the fraction is
    positive and there are 2+ conversations, and always leaving one for training."""
    if validation_fraction <= 0 or num < 2:
        return 0
    return min(num - 1, max(1, round(num * validation_fraction)))


_ARROW_TYPES = {"input_ids": "int32", "loss_mask": "int8", "position_ids": "int32"}
_ROWS_PER_CHUNK = 4096  # Arrow list offsets are int32: chunks keep any split size within them


def _rows_dataset(rows: dict[str, np.ndarray]) -> Any:
    """A Dataset over the packed [rows,T] arrays, built from Arrow buffers directly (converting
    through Python lists, as `Dataset.from_dict` does, costs ~30x the time and ~5x the memory)."""
    import pyarrow as pa
    from datasets import Dataset, DatasetInfo, Features, Sequence, Value
    from datasets.table import InMemoryTable

    columns = {}
    for name, dtype in _ARROW_TYPES.items():
        arr = rows[name]  # [rows,T]
        num_rows, seq_len = arr.shape
        chunks = []
        for a in range(0, num_rows, _ROWS_PER_CHUNK):
            part = np.ascontiguousarray(arr[a:a + _ROWS_PER_CHUNK], dtype=dtype)
            offsets = np.arange(0, part.size + 1, seq_len, dtype=np.int32)
            chunks.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(part.reshape(-1))))
        columns[name] = pa.chunked_array(chunks, type=pa.list_(pa.from_numpy_dtype(np.dtype(dtype))))
    features = Features({name: Sequence(Value(dtype)) for name, dtype in _ARROW_TYPES.items()})
    return Dataset(InMemoryTable(pa.table(columns)), info=DatasetInfo(features=features))


def _save(rows: dict[str, np.ndarray], path: Path) -> None:
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if path.exists():
        shutil.rmtree(path)
    quiet = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        ds = _rows_dataset(rows)
        # An empty split still needs one (empty) shard, else `load_from_disk` fails on it.
        ds.save_to_disk(str(path), num_shards=1 if len(ds) == 0 else None)
    finally:
        if not quiet:
            enable_progress_bars()


def prepare_dataset(data_path: str | Path, tokenizer: Any, out_dir: str | Path, *, seq_len: int,
                    max_conversations: int | None = None, validation_fraction: float = 0.02, seed: int = 0,
                    chat_template: str | None = None, enable_thinking: bool | None = None,
                    long_documents: LongDocuments = "split", weights: SourceWeights | None = None,
                    workers: int = 1, eval_index: EvalIndex | None = None) -> PrepareReport:
    """Prepare packed train/validation rows of T=seq_len tokens under `out_dir`; returns the report.

    `max_conversations` stops reading once that many conversations were kept (None = whole file);
    on the packaged ShareGPT file reading also stops before the held-out tail (data/sources.py).
    `chat_template` (template text) overrides the tokenizer's; `enable_thinking` None = not passed
    to the template. `weights` (`SourceWeights.load(spec, data_path)`) weights conversations by
    their source (data/mixture/weights.py). `workers` > 1 renders and tokenizes conversations in that
    many forked processes (data/tokenize_pool.py): the same bytes, faster. `eval_index` (default
    `EvalIndex.load()`, built once per process) holds the eval prompts of the leak check (module
    docstring; a suite left out for a missing package is in the report's `missing_suites`). Raises ValueError for bad
    settings (workers < 1 too), a tokenizer without a template, or data without a single usable
    conversation; FileNotFoundError for a missing data file or eval package (MT-Bench, HumanEval); RuntimeError naming the conversation when
    rendering it fails with anything but a counted skip, or when a worker process dies.
    """
    data_path = Path(data_path)
    out_dir = Path(out_dir)
    if not data_path.is_file():
        raise FileNotFoundError(f"data file {data_path} does not exist")
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction} must be in [0, 1)")
    if max_conversations is not None and max_conversations <= 0:
        raise ValueError(f"max_conversations={max_conversations} must be positive (or None for all)")
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (1 = this process only)")
    if long_documents not in ("truncate", "split"):
        raise ValueError(f"long_documents={long_documents!r} must be 'truncate' or 'split'")
    template = resolve_chat_template(tokenizer, chat_template)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("tokenizer has neither a pad nor an eos token; set tokenizer.pad_token before preparing")

    stats = ReadStats()
    convs: list[list[_Doc]] = []  # per kept conversation: its documents (one, or one per assistant turn)
    conv_sources: list[str | None] = []  # per kept conversation: the record's `source` field
    expanded = expanded_docs = 0
    limit = training_conversation_limit(data_path)  # the packaged ShareGPT file: its training end
    usable = 0
    index = eval_index or EvalIndex.load()
    leak_check = LeakCheck.start(index)

    def weighted() -> Iterator[Conversation]:  # the usable conversations, less those of weight-0 sources
        nonlocal usable
        for conv in itertools.islice(iter_conversations(data_path, stats), limit):  # never pulls conversation `limit`
            usable += 1
            if weights is not None and not weights.take(conv.source):  # counted, not tokenized
                stats.reject("weight_0", conv.where)
                continue
            kept = leak_check.apply(index, conv.where, conv.source or "(none)", conv.messages)
            if kept is None:
                stats.reject("eval_leak", conv.where)
                continue
            yield conv if kept is conv.messages else dataclasses.replace(conv, messages=kept)

    room = (lambda: None) if max_conversations is None else (lambda: max_conversations - len(convs))
    for res in tokenized_in_order(weighted(), tokenizer, chat_template=template, enable_thinking=enable_thinking,
                                  workers=workers, room=room):
        conv = res.conversation
        if res.skipped is not None:
            stats.reject(res.skipped, conv.where)
            continue
        if not any(mask.any() for _, mask in res.documents):
            stats.reject("no_supervised_tokens", conv.where)
            continue
        convs.append([_Doc(conv.id, ids, mask, conv.where) for ids, mask in res.documents])
        conv_sources.append(conv.source)
        if res.expanded:
            expanded += 1
            expanded_docs += len(res.documents)
        if max_conversations is not None and len(convs) >= max_conversations:
            break
    if weights is not None:  # each conversation 0, 1, 2 … times, its copies one unit of the split
        convs, conv_sources = weights.apply(convs, conv_sources, stats)
    assert stats.kept == len(convs), (stats.kept, len(convs))
    if not convs:
        top = stats.skipped.most_common(1)[0][0] if stats.skipped else None
        raise ValueError(f"no usable conversation in {data_path} (read {stats.read}, skipped "
                         f"{dict(stats.skipped)}); {SKIP_FIXES.get(top, _FORMAT_FIX)}")

    # Split conversations before packing: no conversation (none of its per-turn documents) reaches both splits,
    # nor does a prompt: records of one id (a regeneration's samples of one conversation) are one unit
    ids = Counter(c[0].id for c in convs)
    val_set = validation_set([c[0].id for c in convs], validation_fraction, seed)
    num_val = len(val_set)
    split_convs = {"validation": [c for i, c in enumerate(convs) if i in val_set],
                   "train": [c for i, c in enumerate(convs) if i not in val_set]}
    split_docs = {split: [d for c in cs for d in c] for split, cs in split_convs.items()}
    sources = _source_counts(conv_sources, val_set)

    packed = {split: pack_documents(split_docs[split], seq_len, pad_id, seed=seed, long_documents=long_documents)
              for split in SPLITS}
    tr, va = packed["train"][1], packed["validation"][1]
    if tr.rows == 0:
        raise ValueError(f"no training row: every training document lost its supervised tokens "
                         f"(long_documents={long_documents!r}, seq_len={seq_len})")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / REPORT_NAME).unlink(missing_ok=True)  # a folder without a report is not a finished one
    for split in SPLITS:
        _save(packed[split][0], out_dir / split)
    total_slots = (tr.rows + va.rows) * seq_len
    report = PrepareReport(
        data_path=recorded_data_path(data_path, out_dir), data_sha256=file_sha256(data_path),
        data_bytes=data_path.stat().st_size,
        tokenizer_name=recorded_target(tokenizer_name(tokenizer)), tokenizer_vocab_size=len(tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), transformers_version=_transformers_version(),
        chat_template_sha256=chat_template_sha256(template),
        chat_template_source="explicit" if chat_template else "tokenizer", enable_thinking=enable_thinking,
        seq_len=seq_len, seed=seed, validation_fraction=validation_fraction, max_conversations=max_conversations,
        long_documents=long_documents, pad_id=int(pad_id),
        conversations_read=stats.read, conversations_kept=stats.kept, conversations_skipped=stats.num_skipped,
        skipped_by_reason=dict(sorted(stats.skipped.items())), skip_examples=dict(sorted(stats.examples.items())),
        leading_assistant_turns_dropped=stats.leading_assistant_dropped,
        trailing_turns_dropped=stats.trailing_turns_dropped,
        expanded_per_turn=expanded, expanded_per_turn_documents=expanded_docs,
        conversations_train=len(split_convs["train"]), conversations_validation=num_val,
        validation_ids=list(dict.fromkeys(c[0].id for c in split_convs["validation"])),
        ids_shared=sum(n for n in ids.values() if n > 1),
        heldout_start=sharegpt_heldout_start(data_path) if is_packaged_sharegpt(data_path) else limit,
        training_end=limit,
        stopped_at_heldout=limit is not None and usable == limit, eval_leak_check=leak_check, sources=sources,
        spec=weights.report.portable(out_dir) if weights is not None else None,
        train=tr, validation=va, rows_train=tr.rows, rows_validation=va.rows, tokens=tr.tokens + va.tokens,
        supervised_tokens=tr.supervised_tokens + va.supervised_tokens,
        padding_fraction=(tr.padding_tokens + va.padding_tokens) / total_slots,
    )
    (out_dir / REPORT_NAME).write_text(report.model_dump_json(indent=2) + "\n")
    return report


def validation_set(ids: list[str], validation_fraction: float, seed: int) -> set[int]:
    """Indices of the conversations (by their record ids, in file order) that form the validation split:
    `split_counts` of the distinct ids, drawn by a seeded shuffle, every conversation of a drawn id with
    it. Records sharing an id, such as `regenerate --samples` copies of one prompt ("sample": s), so never
    reach both splits; with distinct ids this is a seeded shuffle of the conversations (the split of
    every earlier prepare). Example: ids [a, b, a, c] with 1 of 3 ids drawn, say a: {0, 2}."""
    groups: dict[str, list[int]] = {}
    for i, conv_id in enumerate(ids):
        groups.setdefault(conv_id, []).append(i)
    units = list(groups.values())
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    return {i for u in order[:split_counts(len(units), validation_fraction)] for i in units[u]}


def _source_counts(conv_sources: list[str | None], val_set: set[int]) -> dict[str, SourceConversations]:
    """Kept conversations per `source` field and split, with licences (data/mixture); {} when no
    record names a source."""
    if not any(conv_sources):
        return {}
    from dflash_trainer.data.mixture.licences import source_licence

    out: dict[str, SourceConversations] = {}
    for i, name in enumerate(conv_sources):
        name = name or "(none)"
        c = out.setdefault(name, SourceConversations(licence=source_licence(name)))
        if i in val_set:
            c.conversations_validation += 1
        else:
            c.conversations_train += 1
    return dict(sorted(out.items()))
