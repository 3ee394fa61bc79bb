"""Anchor positions: where draft blocks start (DFlash, arXiv 2602.06036 §4; docs/architecture.md).

Shapes: R rows, T packed tokens, N anchors per row.

A packed row holds several documents; the start of the document holding position p is
`p - position_ids[p]` (position ids restart at 0 in each document, padding is one last
pseudo-document). An anchor a is valid when the token after it is supervised in the same
document, so that slot 1 of its block has a label.

Sampling runs on the row's device with no host synchronization: random scores, masked to the
valid positions, `topk`, then a sort by position. Rows always get exactly N anchors; picks that
fall on invalid positions (rows with fewer than N valid positions) are flagged invalid and
contribute nothing downstream.
"""

from __future__ import annotations

import torch


def valid_anchor_positions(loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Positions that may start a draft block.

    loss_mask: [R,T] bool or integer (nonzero = supervised). position_ids: [R,T] integer,
    restarting at 0 in each packed document.
    Returns [R,T] bool: True at a iff loss_mask[a] and loss_mask[a+1] and a+1 is in the same
    document as a (position_ids[a+1] == position_ids[a] + 1). The last position is never valid.
    Raises ValueError when the shapes differ or are not 2-D.
    Source: DFlash paper §4 (anchors on response tokens); docs/architecture.md "Semantics".
    """
    if loss_mask.dim() != 2 or loss_mask.shape != position_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and position_ids {tuple(position_ids.shape)} "
                         "must both be [R,T]")
    sup = loss_mask.bool()
    nxt_same_doc = position_ids[:, 1:] == position_ids[:, :-1] + 1  # [R,T-1]
    valid = sup[:, :-1] & sup[:, 1:] & nxt_same_doc  # [R,T-1]
    return torch.cat([valid, valid.new_zeros(valid.shape[0], 1)], dim=1)  # [R,T]


def _first_max_per_document(scores: torch.Tensor, valid: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
    """[R,T] bool: the single highest-scoring valid position of each document (lowest position on ties).

    Two scatter-reduces over the document-start index (size [R,T], no [docs,T] temporary).
    """
    R, T = scores.shape
    best = torch.full_like(scores, -1.0).scatter_reduce(1, doc_start, scores, reduce="amax", include_self=True)
    is_max = valid & (scores == best.gather(1, doc_start))  # [R,T], ties possible
    pos = torch.arange(T, device=scores.device).expand(R, T)
    cand = torch.where(is_max, pos, T)
    first = torch.full_like(pos, T).scatter_reduce(1, doc_start, cand, reduce="amin", include_self=True)
    return is_max & (pos == first.gather(1, doc_start))


def row_uniforms(generator: torch.Generator | list[torch.Generator] | None, rows: int, length: int,
                 device: torch.device) -> torch.Tensor:
    """[rows, length] fp32 uniforms in [0, 1): from one generator for all rows, from one generator
    per row (a list of `rows`; row r then depends only on its own generator), or the global RNG."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != rows:
            raise ValueError(f"{len(generator)} generators for {rows} rows; give one per row")
        return torch.stack([torch.rand(length, generator=g, device=device) for g in generator])
    return torch.rand(rows, length, generator=generator, device=device)


def sample_anchors(loss_mask: torch.Tensor, position_ids: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | list[torch.Generator] | None, per_document_quota: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample N anchors per row, uniformly without replacement over the valid positions.

    Method (no host syncs, everything on loss_mask's device): draw a score u ~ U[0,1) per
    position (`torch.rand` with `generator`, which must live on that device), set the score of
    invalid positions to -1, take the N highest scores with `topk`, then sort the picks by
    position. The N largest of i.i.d. uniform scores form a uniformly random N-subset, so every
    valid position is equally likely. A pick is valid iff its score is >= 0; when a row has fewer
    than N valid positions the remaining picks land on invalid positions (distinct, arbitrary)
    and are returned with anchor_valid False, sorted among the others by position.

    per_document_quota: add 1 to the score of the best-scoring valid position of each document
    (document start = arange(T) - position_ids; per-document max via scatter_reduce, lowest
    position on ties). Those positions outrank all others, so when N >= the number of documents
    with a valid position, every such document gets at least one anchor; the rest of the picks
    stay uniform among the remaining valid positions. Short documents are then over-sampled
    relative to plain uniform sampling.

    generator: one generator for all rows, or a list of R generators, one per row (row r's scores
    then depend only on its own generator: how rows are grouped into batches does not matter).
    loss_mask: [R,T] bool/int. position_ids: [R,T] int (restart at 0 per document).
    Returns (anchors [R,N] int64 ascending along N, anchor_valid [R,N] bool).
    Raises ValueError when num_anchors < 1 or T < num_anchors (or on bad shapes).
    Source: DFlash paper §4 (random anchors per sequence); docs/architecture.md "Semantics"
    (sorted anchors, validity); sync-free ops (rand, topk, sort, scatter_reduce, where), checked
    in `tests/unit/test_anchors.py`.
    """
    valid = valid_anchor_positions(loss_mask, position_ids)  # [R,T] bool
    R, T = valid.shape
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors} must be >= 1")
    if T < num_anchors:
        raise ValueError(f"num_anchors={num_anchors} exceeds the row length T={T}; lower num_anchors")
    device = valid.device
    u = row_uniforms(generator, R, T, device)  # [R,T] in [0,1)
    scores = torch.where(valid, u, -1.0)
    if per_document_quota:
        doc_start = torch.arange(T, device=device) - position_ids.long()  # [R,T]
        scores = scores + _first_max_per_document(scores, valid, doc_start).to(scores.dtype)
    top_scores, picks = torch.topk(scores, num_anchors, dim=1, sorted=False)  # [R,N]
    anchors, order = torch.sort(picks, dim=1)  # ascending positions
    anchor_valid = top_scores.gather(1, order) >= 0
    return anchors, anchor_valid
