"""Prepare's hot loop, the chat template and tokenizer over each conversation, in worker processes.

Rendering every assistant turn as served (per_turn.py) costs milliseconds per conversation in
Python and jinja; on 50K+ regenerated conversations one process spends minutes on it, on a host
whose other cores idle. `tokenized_in_order` hands conversations to forked workers in chunks and
yields the results in input order, so the prepared rows are the same bytes for any worker count.

Workers are forked (they inherit the loaded tokenizer: no reload, no pickling of it); where the
platform cannot fork, or `workers` ≤ 1, the same function runs in this process.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from dflash_trainer.data.chat import Conversation
from dflash_trainer.data.per_turn import conversation_documents
from dflash_trainer.data.tokenize import ConversationSkipped

_CHUNK_PER_WORKER = 64  # conversations per worker per chunk: enough to amortize the hand-off, bounded memory
_STATE: dict[str, Any] = {}  # set before the fork; the workers read it


class Tokenized(NamedTuple):
    """One conversation's result. `skipped` is the ConversationSkipped reason (then `documents` is
    empty); `documents` holds (input_ids int32 [n], loss_mask int8 [n]) per document."""

    conversation: Conversation
    skipped: str | None
    documents: list[tuple[np.ndarray, np.ndarray]]
    expanded: bool


def default_workers() -> int:
    """The cores this process may use, at most 16 (beyond that the hand-off dominates)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


def _tokenize(conv: Conversation) -> tuple[str | None, list[tuple[np.ndarray, np.ndarray]], bool]:
    try:
        out = conversation_documents(_STATE["tokenizer"], conv.messages, chat_template=_STATE["template"],
                                     enable_thinking=_STATE["enable_thinking"])
    except ConversationSkipped as e:
        return e.reason, [], False
    docs = [(np.asarray(d.input_ids, dtype=np.int32), np.asarray(d.loss_mask, dtype=np.int8)) for d in out.documents]
    return None, docs, out.expanded


def tokenized_in_order(conversations: Iterator[Conversation], tokenizer: Any, *, chat_template: str,
                       enable_thinking: bool | None, workers: int,
                       room: Callable[[], int | None] = lambda: None) -> Iterator[Tokenized]:
    """Yield each conversation of `conversations` tokenized (per_turn.conversation_documents), in order.

    `room()` is asked before each chunk is read: how many more conversations the caller may still
    keep (None = no limit). A chunk never reads more than that, so a caller that stops at a kept
    count reads exactly the conversations a one-by-one loop would. The caller must consume every
    result of a chunk before the next is read (a plain for loop does). `workers` ≤ 1 tokenizes in
    this process. Raises what the tokenizer raises other than ConversationSkipped.
    """
    _STATE.update(tokenizer=tokenizer, template=chat_template, enable_thinking=enable_thinking)
    try:
        if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            for conv in conversations:
                yield Tokenized(conv, *_tokenize(conv))
            return
        # the parent may have used the tokenizer's thread pool; its forked copies must not
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                while True:
                    n = workers * _CHUNK_PER_WORKER
                    left = room()
                    if left is not None:
                        n = min(n, left)
                    chunk = list(itertools.islice(conversations, n)) if n > 0 else []
                    if not chunk:
                        return
                    results = pool.map(_tokenize, chunk, chunksize=max(1, len(chunk) // (4 * workers)))
                    for conv, res in zip(chunk, results):
                        yield Tokenized(conv, *res)
        finally:
            if previous is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous
    finally:
        _STATE.clear()
