"""One target forward per document of the packed rows, scattered back into the packed layout.

Shapes: R = rows, T = packed tokens per row, n = documents in one forward, S = their longest length,
H = hidden size.

For targets whose layers carry state across positions (`families.py`: gated-delta-net linear
attention, Mamba mixers, short convolutions) a forward over a packed row would carry one document's
state into the next; no attention mask can stop it. Here each document (a run of positions whose
start p − position_ids[p] is the same, `packed_masks.document_starts`; the padding tail is one
more) runs as its own sequence: the documents are sorted longest first and grouped into padded
batches of at most max(T, S) tokens, RIGHT-padded, with no attention mask. Every layer of a causal
LM is causal, so a document's outputs do not depend on the padding after it: each document's
features are exactly those of the target's own forward of that document alone (up to the batch's
floating-point rounding). Position ids are the document's own (p − start), continued into the
padding. The drafter still sees packed rows: only the target forward is split.

Cost: the padding of each batch (bounded by sorting; none when every document of a batch has the
same length) and one forward per batch instead of one per R rows; the document bounds are read on
the host (one sync per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trainer.target_model.packed_masks import document_starts


@dataclass(frozen=True)
class DocumentBatch:
    """One padded forward: input_ids / position_ids [n,S] int64; src / dst [m] int64 with m the
    documents' total length: row src of the flattened [n·S] outputs goes to row dst of the
    flattened [R·T] packed layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


def document_spans(position_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, length) of every document of the packed rows, padding tail included.

    position_ids: [R,T] integer (any device; read on the host). A document is a maximal run of
    positions with the same start p − position_ids[p]. Covers every position exactly once.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must be [R,T]")
    start = document_starts(position_ids.detach().to("cpu", torch.long))  # host sync: the bounds drive the batching
    R, T = start.shape
    spans = []
    for r in range(R):
        cuts = [0] + (torch.nonzero(start[r, 1:] != start[r, :-1]).flatten() + 1).tolist() + [T]
        spans += [(r, a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]
    return spans


def group_spans(spans: list[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Spans sorted longest first, cut into groups of at most max(budget, longest) padded tokens
    (count × the group's first, longest length). Deterministic (ties keep row order)."""
    order = sorted(spans, key=lambda s: -s[2])
    groups: list[list[tuple[int, int, int]]] = []
    for span in order:
        if groups and (len(groups[-1]) + 1) * groups[-1][0][2] <= max(budget, groups[-1][0][2]):
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def document_batches(input_ids: torch.Tensor, position_ids: torch.Tensor) -> list[DocumentBatch]:
    """The padded per-document forwards of packed rows input_ids / position_ids [R,T] (same device),
    groups of at most T padded tokens (or the longest document). Padding token id 0."""
    R, T = input_ids.shape
    device = input_ids.device
    batches = []
    for group in group_spans(document_spans(position_ids), T):
        S = group[0][2]
        ids = torch.zeros(len(group), S, dtype=torch.long, device=device)
        pos = torch.zeros(len(group), S, dtype=torch.long, device=device)
        src, dst = [], []
        for i, (r, a, n) in enumerate(group):
            ids[i, :n] = input_ids[r, a:a + n]
            pos[i] = position_ids[r, a] + torch.arange(S, device=device)
            src.append(torch.arange(i * S, i * S + n))
            dst.append(torch.arange(r * T + a, r * T + a + n))
        batches.append(DocumentBatch(ids, pos, torch.cat(src).to(device), torch.cat(dst).to(device)))
    return batches


def scatter(out: torch.Tensor, batch: DocumentBatch, values: torch.Tensor) -> None:
    """Write a batch's outputs values [n,S,C] into the packed out [R,T,C] (a view with any column
    slice is fine): out at the documents' packed positions gets the values at their own ones."""
    R, T, C = out.shape
    n, S, _ = values.shape
    out.view(R * T, C).index_copy_(0, batch.dst, values.reshape(n * S, C).index_select(0, batch.src))
