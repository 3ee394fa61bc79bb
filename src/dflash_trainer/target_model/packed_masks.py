"""Attention visibility inside the frozen target over packed rows: one definition, two realizations.

Shapes: R = rows, T = packed tokens per row, W = sliding window, n = T/128 tiles per side.

Definition (docs/architecture.md, `data/`): the start of the document holding position p is
start(p) = p − position_ids[p]. Query q sees key p iff start(p) = start(q) and
p ≤ q; a sliding-window layer also needs q − p < W (transformers' `sliding_window_overlay`).

Realizations:
  * `packed_causal_mask`: dense boolean [R,1,T,T] (True = attend) for SDPA (any T, any device).
  * `document_block_masks`: flex `BlockMask`s built directly from the position ids, one build
    for the whole batch of rows, every window from one pass, no host sync (checked in
    `tests/unit/test_target_flex.py`).
    Their partial tiles apply `document_mask_mod`, the definition above, element by element.

Tile rule of the BlockMask (q tile i = queries [128i, 128i+128), kv tile j likewise), with
lo_j / hi_j the smallest / largest document start inside tile j:
  * visited iff j = i, or j < i and [lo_j, hi_j] meets [lo_i, hi_i] (and with W:
    128(i − j) − 127 < W, the nearest pair of the two tiles is inside the window);
  * full    iff j < i and lo_j = hi_j = lo_i = hi_i (one document covers both tiles; with W:
    128(i − j) + 127 < W, the farthest pair is inside the window); a diagonal tile is never full.
Every visible pair lies in a visited tile and every pair of a full tile is visible, for ANY
position ids, so the realized mask always equals the definition. When each document is a run of
positions 0, 1, 2, … (what `data/pack.py` writes; then start(p) never decreases along the row)
the tables are also exactly those of `create_block_mask(document_mask_mod(...), R, 1, T, T)`;
position ids that jump up by more than one inside a row only visit a few more tiles.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

TILE = 128  # flex attention's default sparse block size (queries and keys)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[R,T] int64: index of the first token of the document holding each position (p − pos[p])."""
    T = position_ids.shape[-1]
    idx = torch.arange(T, device=position_ids.device, dtype=torch.long)
    return idx - position_ids.long()


def packed_causal_mask(position_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """4D boolean attention mask [R,1,T,T] for packed rows; True = attend.

    Query q sees key p iff both lie in the same document (equal document starts, derived from
    position ids) and p ≤ q; with `sliding_window` W also q − p < W. Built by broadcasting
    [R,T,1] against [R,1,T]: no [num_docs, T] temporary, no host sync. O(R·T²) memory
    (8192² = 64 MiB per row): the SDPA realization, used on CPU.
    """
    start = document_starts(position_ids)  # [R,T]
    T = start.shape[-1]
    idx = torch.arange(T, device=start.device)
    causal = idx[None, :] <= idx[:, None]  # [T(q),T(k)]
    if sliding_window is not None:
        causal &= (idx[:, None] - idx[None, :]) < sliding_window
    same_doc = start[:, :, None] == start[:, None, :]  # [R,T(q),T(k)]
    return (same_doc & causal).unsqueeze(1)  # [R,1,T,T]


def document_mask_mod(start: torch.Tensor, window: int | None) -> Callable:
    """The definition as a flex `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    start: [R,T] int64 document starts (`document_starts`), on the attention's device (captured,
    not copied). window: W, or None for full attention. Two gathers and comparisons joined with
    `&` (no data-dependent branch). Raises ValueError for window < 1.
    """
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (start[b, kv_idx] == start[b, q_idx]) & (kv_idx <= q_idx)
        return mask_mod
    if window < 1:
        raise ValueError(f"sliding_window={window} must be >= 1")
    W = int(window)

    def windowed_mask_mod(b, h, q_idx, kv_idx):
        return (start[b, kv_idx] == start[b, q_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx < W)
    return windowed_mask_mod


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile bools [R,n,m] → (counts [R,1,n] int32, indices [R,1,n,m] int32) in torch's order
    (`flex_attention._dense_to_ordered`: a stable descending argsort, i.e. the selected columns
    ascending, then the others). No host sync."""
    t = tiles.to(torch.int32)
    count = t.sum(dim=-1, dtype=torch.int32)  # [R,n]
    idx = torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)  # [R,n,m]
    return count[:, None].contiguous(), idx[:, None].contiguous()


def document_block_masks(position_ids: torch.Tensor, windows: list[int | None]) -> dict[int | None, BlockMask]:
    """Flex BlockMasks of the packed-row definition for every distinct window, built directly.

    position_ids: [R,T] integer (restarting at 0 in each document), on the attention's device;
    T must be a multiple of 128. windows: W values (None = full attention), duplicates allowed.
    Returns {window: BlockMask} with seq_lengths (T, T), BLOCK_SIZE (128, 128), batch R, H = 1
    (broadcast over heads), mask_mod = `document_mask_mod(start, window)`, tile tables by the rule
    of the module docstring. Cost: O(R·T) to find the tile ranges, O(R·n²) for the tables
    (n = 64 at T = 8192); no mask_mod evaluation, no host sync, no compile.
    Raises ValueError when position_ids is not [R,T], T % 128 != 0 or a window < 1.
    Source: docs/architecture.md (packed rows); torch flex_attention `BlockMask` (its tables);
    `tests/unit/test_target_flex.py` (equal to `create_block_mask`, no host sync).
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must be [R,T]")
    R, T = position_ids.shape
    if T % TILE:
        raise ValueError(f"T={T}: the flex path needs rows of a multiple of {TILE} tokens "
                         f"(seq_len {(T // TILE + 1) * TILE}, or target_attention=sdpa)")
    for w in windows:
        if w is not None and w < 1:
            raise ValueError(f"sliding_window={w} must be >= 1")
    n = T // TILE
    device = position_ids.device
    start = document_starts(position_ids)  # [R,T]
    tiles = start.view(R, n, TILE)
    lo, hi = tiles.amin(dim=-1), tiles.amax(dim=-1)  # [R,n] document-start range of each tile
    i = torch.arange(n, device=device)[:, None]  # q tile
    j = torch.arange(n, device=device)[None, :]  # kv tile
    below, diag = j < i, j == i  # [n,n]
    meets = (hi[:, None, :] >= lo[:, :, None]) & (lo[:, None, :] <= hi[:, :, None])  # [R,n(q),n(kv)]
    one_doc = (lo == hi)
    same_one = one_doc[:, :, None] & one_doc[:, None, :] & (lo[:, :, None] == lo[:, None, :])  # [R,n,n]
    gap = (i - j) * TILE  # [n,n] distance between the first queries of the two tiles
    out: dict[int | None, BlockMask] = {}
    for w in dict.fromkeys(windows):
        visited = (below & meets) | diag  # [R,n,n]
        full = below & same_one
        if w is not None:
            visited = visited & (gap - (TILE - 1) < w)
            full = full & (gap + (TILE - 1) < w)
        partial = visited & ~full
        kv_num, kv_idx = _ordered(partial)
        fkv_num, fkv_idx = _ordered(full)
        q_num, q_idx = _ordered(partial.transpose(1, 2))
        fq_num, fq_idx = _ordered(full.transpose(1, 2))
        out[w] = BlockMask(
            seq_lengths=(T, T), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=fkv_num,
            full_kv_indices=fkv_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=fq_num,
            full_q_indices=fq_idx, BLOCK_SIZE=(TILE, TILE), mask_mod=document_mask_mod(start, w))
    return out
