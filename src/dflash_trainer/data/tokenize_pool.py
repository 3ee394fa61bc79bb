"""Prepare's hot loop, the chat template and tokenizer over each conversation, in worker processes.

Rendering every assistant turn as served (per_turn.py) costs milliseconds per conversation in
Python and jinja; on 50K+ regenerated conversations one process spends minutes on it, on a host
whose other cores idle (H200 host, 16 cores: 67,544 conversations in 51 s). `tokenized_in_order`
hands conversations to forked workers in chunks and yields the results in input order, so the
prepared rows are the same bytes for any worker count.

Workers are forked (they inherit the loaded tokenizer: no reload, no pickling of it) when the
executor takes its first task, all at once (CPython ≥ 3.11.1; 3.11.0 forks them on demand, which
only lets the tokenizer print a warning); `TOKENIZERS_PARALLELISM=false` is set only around that fork, so the
workers' copies never use the tokenizer's thread pool and nothing is printed about it. Where the
platform offers no fork (Windows), or `workers` ≤ 1, the same function runs in this process. Forking
a process that already runs threads (torch, BLAS) is what Python 3.12 warns about with a
DeprecationWarning; the workers only run Python, jinja and the Rust tokenizer, never those pools.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import numpy as np

from dflash_trainer.data.chat import Conversation
from dflash_trainer.data.per_turn import conversation_documents
from dflash_trainer.data.tokenize import ConversationSkipped

_CHUNK_PER_WORKER = 64  # conversations per worker per chunk: enough to amortize the hand-off, bounded memory
_STATE: dict[str, Any] = {}  # the tokenizer and settings, set in the parent before the fork; the workers read it


class Tokenized(NamedTuple):
    """One conversation's result. `skipped` is the ConversationSkipped reason (then `documents` is
    empty); `documents` holds (input_ids int32 [n], loss_mask int8 [n]) per document."""

    conversation: Conversation
    skipped: str | None
    documents: list[tuple[np.ndarray, np.ndarray]]
    expanded: bool


def default_workers() -> int:
    """The cores this process may use (its CPU affinity), at most 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


def _tokenize(conv: Conversation) -> tuple[str, Any]:
    """("ok", (skipped reason | None, documents, expanded)) or ("error", a formatted traceback): an
    error travels back as text, so an exception that does not pickle cannot break the pool."""
    try:
        out = conversation_documents(_STATE["tokenizer"], conv.messages, chat_template=_STATE["template"],
                                     enable_thinking=_STATE["enable_thinking"])
    except ConversationSkipped as e:
        return "ok", (e.reason, [], False)
    except Exception:
        return "error", traceback.format_exc(limit=4)
    docs = [(np.asarray(d.input_ids, dtype=np.int32), np.asarray(d.loss_mask, dtype=np.int8)) for d in out.documents]
    return "ok", (None, docs, out.expanded)


def _result(conv: Conversation, status: str, value: Any) -> Tokenized:
    if status == "error":
        raise RuntimeError(f"conversation {conv.where}: rendering or tokenizing it failed:\n{value}")
    return Tokenized(conv, *value)


def _noop() -> None:
    """Submitted once so that the executor forks its workers at once (while the environment is set)."""


def tokenized_in_order(conversations: Iterable[Conversation], tokenizer: Any, *, chat_template: str,
                       enable_thinking: bool | None, workers: int,
                       room: Callable[[], int | None] = lambda: None) -> Iterator[Tokenized]:
    """Yield each conversation of `conversations` tokenized (per_turn.conversation_documents), in order.

    `room()` is asked before each chunk is read: how many more conversations the caller may still
    keep (None = no limit). A chunk never reads more than that, so a caller that stops at a kept
    count reads exactly the conversations a one-by-one loop would. The caller must consume every
    result of a chunk before the next is read (a plain for loop does). `workers` ≤ 1 tokenizes in
    this process. Raises RuntimeError naming the conversation when rendering or tokenizing fails
    with anything but ConversationSkipped, and RuntimeError when a worker process dies (killed, out
    of memory); never waits forever on a dead worker.
    """
    conversations = iter(conversations)  # a list would restart at every chunk
    _STATE.update(tokenizer=tokenizer, template=chat_template, enable_thinking=enable_thinking)
    try:
        if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            for conv in conversations:
                yield _result(conv, *_tokenize(conv))
            return
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            previous = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # for the forked copies only
            try:
                started = pool.submit(_noop)  # a fork pool (CPython ≥ 3.11.1) forks every worker on its first task
            finally:
                if previous is None:
                    os.environ.pop("TOKENIZERS_PARALLELISM", None)
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = previous
            try:
                started.result()
            except BrokenProcessPool:
                raise RuntimeError("a tokenizing worker process died as it started; --workers 1 runs the "
                                   "tokenizer in this process") from None
            while True:
                n = workers * _CHUNK_PER_WORKER
                left = room()
                if left is not None:
                    n = min(n, left)
                chunk = list(itertools.islice(conversations, n)) if n > 0 else []
                if not chunk:
                    return
                try:
                    results = list(pool.map(_tokenize, chunk, chunksize=max(1, len(chunk) // (4 * workers))))
                except BrokenProcessPool:
                    raise RuntimeError(f"a tokenizing worker process died (killed, or out of memory) on conversations "
                                       f"{chunk[0].id} … {chunk[-1].id}; run with fewer workers (--workers 1 runs "
                                       f"them in this process)") from None
                for conv, res in zip(chunk, results):
                    yield _result(conv, *res)
    finally:
        _STATE.clear()
