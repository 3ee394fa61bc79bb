"""Pack documents into rows of exactly T tokens.

Shapes: T = tokens per row (seq_len), rows = number of packed rows.

Order: documents are shuffled with `random.Random(seed)` (seed None keeps the given order), then
placed greedily first-fit: each document goes into the lowest-numbered row with room for it, a
new row when none has. First-fit is found in O(log n) with a max-segment-tree over the rows' free
space (checked against the plain O(n·rows) loop in the tests).

Inside a row, documents sit back to back in placement order; `position_ids` restart at 0 at each
document, so a document's start is `p - position_ids[p]`. The free tail of a row is padding
(pad id, loss 0) whose positions also count from 0: one last pseudo-document.

Documents longer than T: `long_documents="split"` (default) cuts them into T-token pieces, each
packed as its own document (positions restart at 0 in each piece); `"truncate"` keeps the first T
tokens. A document (or piece) left without any supervised token is dropped and counted.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel

LongDocuments = Literal["truncate", "split"]


class PackStats(BaseModel):
    """Counts of one packing run. `tokens` excludes padding; `padding_fraction` = padding / (rows·T)."""

    documents: int = 0  # documents given
    documents_packed: int = 0  # documents (or pieces) placed in rows
    truncated: int = 0  # documents cut to T tokens (long_documents="truncate")
    tokens_truncated: int = 0  # tokens dropped by truncation
    split: int = 0  # documents cut into pieces (long_documents="split")
    split_pieces: int = 0  # pieces those documents became
    skipped_no_supervision: int = 0  # documents or pieces without any supervised token
    rows: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    padding_tokens: int = 0
    padding_fraction: float = 0.0


class _FirstFit:
    """Max-segment-tree over the free space of up to `n` rows; all rows start empty (free = T)."""

    def __init__(self, n: int, seq_len: int):
        self.size = 1
        while self.size < max(n, 1):
            self.size *= 2
        self.tree = [seq_len] * (2 * self.size)

    def place(self, length: int) -> int:
        """Lowest row with free space ≥ length; reserves the space and returns the row."""
        assert self.tree[1] >= length, "more pieces than rows"
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= length else 2 * node + 1
        row = node - self.size
        self.tree[node] -= length
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2
        return row


def _pieces(ids: np.ndarray, mask: np.ndarray, seq_len: int, long_documents: LongDocuments,
            stats: PackStats) -> list[tuple[np.ndarray, np.ndarray]]:
    n = len(ids)
    if n <= seq_len:
        return [(ids, mask)]
    if long_documents == "truncate":
        stats.truncated += 1
        stats.tokens_truncated += n - seq_len
        return [(ids[:seq_len], mask[:seq_len])]
    stats.split += 1
    out = [(ids[s:s + seq_len], mask[s:s + seq_len]) for s in range(0, n, seq_len)]
    stats.split_pieces += len(out)
    return out


def pack_documents(documents: Sequence[Any], seq_len: int, pad_id: int, *, seed: int | None = 0,
                   long_documents: LongDocuments = "split") -> tuple[dict[str, np.ndarray], PackStats]:
    """Pack documents (objects with `input_ids` and `loss_mask` sequences) into rows of T=seq_len.

    Returns ({"input_ids": int32 [rows,T], "loss_mask": int8 [rows,T], "position_ids": int32
    [rows,T]}, stats). Deterministic for a seed.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive")
    if long_documents not in ("truncate", "split"):
        raise ValueError(f"long_documents={long_documents!r} must be 'truncate' or 'split'")
    stats = PackStats(documents=len(documents))
    order = list(range(len(documents)))
    if seed is not None:
        random.Random(seed).shuffle(order)

    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for d in order:
        doc = documents[d]
        ids = np.asarray(doc.input_ids, dtype=np.int32)
        mask = np.asarray(doc.loss_mask, dtype=np.int8)
        assert ids.shape == mask.shape and ids.ndim == 1, (ids.shape, mask.shape)
        for p_ids, p_mask in _pieces(ids, mask, seq_len, long_documents, stats):
            if not p_mask.any():
                stats.skipped_no_supervision += 1
                continue
            pieces.append((p_ids, p_mask))

    fit = _FirstFit(len(pieces), seq_len)
    placements = [fit.place(len(p_ids)) for p_ids, _ in pieces]  # row of each piece
    num_rows = max(placements) + 1 if placements else 0

    input_ids = np.full((num_rows, seq_len), pad_id, dtype=np.int32)  # [rows,T]
    loss_mask = np.zeros((num_rows, seq_len), dtype=np.int8)  # [rows,T]
    position_ids = np.zeros((num_rows, seq_len), dtype=np.int32)  # [rows,T]
    fill = np.zeros(num_rows, dtype=np.int64)  # tokens used per row
    for (p_ids, p_mask), row in zip(pieces, placements):
        a, n = fill[row], len(p_ids)
        input_ids[row, a:a + n] = p_ids
        loss_mask[row, a:a + n] = p_mask
        position_ids[row, a:a + n] = np.arange(n, dtype=np.int32)
        fill[row] += n
    for row in range(num_rows):  # padding tail = one pseudo-document with positions from 0
        a = fill[row]
        position_ids[row, a:] = np.arange(seq_len - a, dtype=np.int32)

    stats.documents_packed = len(pieces)
    stats.rows = num_rows
    stats.tokens = int(fill.sum())
    stats.supervised_tokens = int(loss_mask.sum(dtype=np.int64))
    stats.padding_tokens = num_rows * seq_len - stats.tokens
    stats.padding_fraction = stats.padding_tokens / (num_rows * seq_len) if num_rows else 0.0
    rows = {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids}
    return rows, stats
