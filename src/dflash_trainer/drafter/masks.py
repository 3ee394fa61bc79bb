"""Attention visibility of the draft blocks: one definition, two realizations.

Shapes: R rows, T packed tokens (context keys), N anchors, B block size, Q = N·B block queries,
K = T + Q keys (T context keys, then the Q block keys), W sliding window, nq = Q/128 query tiles,
C = K/128 key tiles.

Definition (DFlash, arXiv 2602.06036 §4; docs/architecture.md "Semantics"). Query q = j·B + k
(slot k of anchor j, context range [lo_j, hi_j) from `blocks.build_blocks`) sees
  * context key p < T  iff  lo_j ≤ p < hi_j, and for sliding-window layers (hi_j + k) − p < W
    (the query sits at position hi_j + k = a_j + k; invalid anchors have [0,0) and see nothing);
  * block key T + i    iff  i // B == j (its own block, bidirectional; never another block).
Positions are compared, never block ids, so overlapping blocks cannot leak future context.

Realizations:
  * `dense_mask` / `build_dense_masks`: boolean [R,Q,K] for SDPA (CPU; no flex backward there).
  * `reference_mask_mod`: the definition as a flex mask_mod (lo[b, q//B], hi[b, q//B], q % B).
  * `build_block_mask` / `build_block_masks`: a flex BlockMask built directly from the ranges,
    bit-identical to `create_block_mask(reference_mask_mod(...), R, 1, Q, K)` without evaluating
    the mask_mod over block pairs and without host syncs.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

TILE = 128  # flex attention's default sparse block size (queries and keys)


def _check_ranges(context_lo: torch.Tensor, context_hi: torch.Tensor) -> None:
    if context_lo.dim() != 2 or context_lo.shape != context_hi.shape:
        raise ValueError(f"context_lo {tuple(context_lo.shape)} and context_hi {tuple(context_hi.shape)} "
                         "must both be [R,N]")


def _check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1 (or None for full attention)")


def dense_mask(context_lo: torch.Tensor, context_hi: torch.Tensor, T: int, block_size: int,
               window: int | None) -> torch.Tensor:
    """Dense visibility matrix of the block queries (vectorized, on context_lo's device).

    context_lo, context_hi: [R,N] integer, context range [lo_j, hi_j) per anchor (hi_j = a_j;
    [0,0) for invalid anchors). T: context keys per row. window: W for sliding-window layers,
    None for full attention.
    Returns bool [R,Q,T+Q]; rows are queries q = j·B + k, columns the T context keys then the Q
    block keys. For SDPA add the head axis: `mask[:, None]` ([R,1,Q,K]).
    Raises ValueError on mismatched shapes, block_size < 1 or window < 1.
    Source: DFlash paper §4 (context + bidirectional block); the sliding rule as z-lab/dflash
    `dflash/model.py` `_attention_mask` (query position − key position < W).
    """
    return build_dense_masks(context_lo, context_hi, T, block_size, [window])[window][:, 0]


def build_dense_masks(context_lo: torch.Tensor, context_hi: torch.Tensor, T: int, block_size: int,
                      windows: list[int | None]) -> dict[int | None, torch.Tensor]:
    """Dense masks for every distinct window, sharing the common work.

    Same inputs as `dense_mask`; windows: list of W (None = full attention), duplicates allowed.
    Returns {window: bool [R,1,Q,T+Q]} — the head axis is already there, ready to pass as SDPA's
    attn_mask (broadcast over heads); `dense_mask` returns the same without it.
    Raises ValueError on mismatched shapes, block_size < 1 or window < 1.
    Source: DFlash paper §4 (the visibility); this dense realization is checked in tests/unit/test_masks.py.
    """
    _check_ranges(context_lo, context_hi)
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    for w in windows:
        _check_window(w)
    R, N = context_lo.shape
    B = block_size
    Q = N * B
    device = context_lo.device
    lo = context_lo.long().repeat_interleave(B, dim=1, output_size=Q)[:, :, None]  # [R,Q,1]
    hi = context_hi.long().repeat_interleave(B, dim=1, output_size=Q)[:, :, None]  # [R,Q,1]
    p = torch.arange(T, device=device)  # [T]
    k = (torch.arange(Q, device=device) % B)[:, None]  # [Q,1] slot of each query
    in_range = (p >= lo) & (p < hi)  # [R,Q,T]
    blk = torch.arange(Q, device=device) // B
    own_block = (blk[:, None] == blk[None, :]).expand(R, Q, Q)  # [R,Q,Q]
    out: dict[int | None, torch.Tensor] = {}
    for w in dict.fromkeys(windows):
        ctx = in_range if w is None else in_range & ((hi + k) - p < w)  # [R,Q,T]
        out[w] = torch.cat([ctx, own_block], dim=2)[:, None]  # [R,1,Q,K]
    return out


def reference_mask_mod(context_lo: torch.Tensor, context_hi: torch.Tensor, T: int, block_size: int,
                       window: int | None) -> Callable:
    """The visibility definition as a flex `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    context_lo, context_hi: [R,N] int32 on the attention's device (captured, not copied).
    Looks up only lo[b, q//B] and hi[b, q//B] and uses q % B for the window; no data-dependent
    branches (& and | only). Used as the mask_mod of the direct BlockMask (for its partial tiles)
    and, in tests, with `create_block_mask` as the slow reference.
    Raises ValueError on mismatched shapes, block_size < 1 or window < 1.
    Source: DFlash paper §4.
    """
    _check_ranges(context_lo, context_hi)
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    _check_window(window)
    lo_t, hi_t, B = context_lo, context_hi, block_size

    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            j = q_idx // B
            lo, hi = lo_t[b, j], hi_t[b, j]
            return ((kv_idx >= lo) & (kv_idx < hi)) | ((kv_idx - T) // B == j)
    else:
        W = window

        def mask_mod(b, h, q_idx, kv_idx):
            j = q_idx // B
            lo, hi = lo_t[b, j], hi_t[b, j]
            ctx = (kv_idx >= lo) & (kv_idx < hi) & (hi + q_idx % B - kv_idx < W)
            return ctx | ((kv_idx - T) // B == j)

    return mask_mod


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile bools [R,nq,C] → (counts [R,1,nq] int32, indices [R,1,nq,C] int32) in torch's order.

    torch orders with a stable descending argsort of the tile bools: the selected columns
    ascending, then the unselected ones ascending. Computed here as ranks from a cumsum and one
    scatter (a permutation), which gives the same order without a sort.
    """
    sel = dense.to(torch.int32)  # [R,nq,C]
    C = sel.shape[-1]
    before = torch.cumsum(sel, dim=-1, dtype=torch.int32) - sel  # selected columns left of c
    count = sel.sum(dim=-1, keepdim=True, dtype=torch.int32)  # [R,nq,1]
    col = torch.arange(C, device=sel.device, dtype=torch.int32)
    rank = torch.where(sel.bool(), before, count + col - before).long()  # [R,nq,C], a permutation
    indices = torch.empty_like(sel).scatter_(-1, rank, col.expand_as(sel).contiguous())
    return count[:, None, :, 0].contiguous(), indices[:, None].contiguous()


def _check_flex_shapes(context_lo: torch.Tensor, T: int, block_size: int) -> None:
    # The user-facing rules are the config's (config/sections.py: the drafter section, data.seq_len,
    # check_flex_tiles); here only the invariant the tiling needs.
    Q = context_lo.shape[1] * block_size
    assert block_size >= 1 and TILE % block_size == 0 and T % TILE == 0 and Q % TILE == 0, \
        f"flex tiles: block_size={block_size}, T={T}, Q={Q} (checked by the config)"


def build_block_masks(context_lo: torch.Tensor, context_hi: torch.Tensor, T: int, block_size: int,
                      windows: list[int | None]) -> dict[int | None, BlockMask]:
    """Flex BlockMasks for every distinct window, built directly from the per-anchor ranges.

    context_lo, context_hi: [R,N] int32, anchors sorted ascending (ranges of invalid anchors
    [0,0)). windows: list of W (None = full attention), duplicates allowed.
    Returns {window: BlockMask} with seq_lengths (Q, T+Q), BLOCK_SIZE 128, H = 1 (broadcast over
    heads), mask_mod = `reference_mask_mod(...)`; the kv and q tile tables are bit-identical to
    `create_block_mask(mask_mod, R, 1, Q, T+Q)`. No host syncs; on context_lo's device.

    Tiles: q tile r holds 128 queries = A = 128/B whole blocks; key tile c covers keys
    [128c, 128c+128). Row (j,k) sees context keys [L_jk, hi_j) with L_jk = lo_j (full) or
    max(lo_j, hi_j + k − W + 1) (window W). Since hi_j does not depend on k, k = 0 is the
    loosest row and k = B−1 the tightest. A context tile is
      * visited iff some anchor j of the q tile has max(L_j0, 128c) < min(hi_j, 128c+128);
      * full    iff every anchor j has L_j,B−1 ≤ 128c and hi_j ≥ 128c+128;
    partial = visited and not full. Key tiles ≥ T/128 hold the blocks: q tile r meets only key tile
    T/128 + r, block-diagonally (full iff B == 128). The windows differ only in L, so the upper
    edge, the tile bounds and the block region are computed once.

    Raises ValueError on mismatched shapes or a window < 1; AssertionError when T % 128, Q % 128
    or 128 % block_size is not 0 (the config refuses these first).
    Source: DFlash paper §4; torch flex_attention `BlockMask` (its tables) and
    `_dense_to_ordered` (index order); benchmarks/reports/2026-11-30-drafter-step.md (build time, equality with
    `create_block_mask`).
    """
    _check_ranges(context_lo, context_hi)
    _check_flex_shapes(context_lo, T, block_size)
    for w in windows:
        _check_window(w)
    R, N = context_lo.shape
    Q = N * block_size
    uniq = tuple(dict.fromkeys(windows))
    tables_fn = _compiled_tables() if context_lo.is_cuda else _tile_tables
    tables = tables_fn(context_lo, context_hi, T, block_size, uniq)
    out: dict[int | None, BlockMask] = {}
    for w, (kv_num, kv_idx, full_num, full_idx, q_num, q_idx, fq_num, fq_idx) in zip(uniq, tables):
        out[w] = BlockMask(
            seq_lengths=(Q, T + Q), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
            full_kv_indices=full_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=fq_num,
            full_q_indices=fq_idx, BLOCK_SIZE=(TILE, TILE),
            mask_mod=reference_mask_mod(context_lo, context_hi, T, block_size, w))
    return out


@functools.cache
def _compiled_tables():
    """`_tile_tables` compiled once per process (fixed shapes): a few fused kernels instead of
    dozens of small eager launches, so the build costs microseconds of GPU time per step."""
    return torch.compile(_tile_tables, dynamic=False)


def _tile_tables(context_lo: torch.Tensor, context_hi: torch.Tensor, T: int, B: int,
                 windows: tuple[int | None, ...]) -> list[tuple[torch.Tensor, ...]]:
    """All eight BlockMask tables per window (kv partial/full, then their q-side transposes).

    Pure tensor code (compilable). Returns per window (kv_num [R,1,nq], kv_idx [R,1,nq,C],
    full_kv_num, full_kv_idx, q_num [R,1,C], q_idx [R,1,C,nq], full_q_num, full_q_idx), int32.
    The q-side tables order the transposed tile bools exactly as torch's `_transpose_ordered`.
    """
    R, N = context_lo.shape
    Q = N * B
    A = TILE // B  # anchors per q tile
    nq, nt = Q // TILE, T // TILE  # q tiles; context key tiles
    device = context_lo.device

    lo = context_lo.long().view(R, nq, A, 1)  # [R,nq,A,1]
    hi = context_hi.long().view(R, nq, A, 1)
    c0 = torch.arange(nt, device=device) * TILE  # [nt] first key of each context tile
    c1 = c0 + TILE
    hi_cap = torch.minimum(hi, c1)  # [R,nq,A,nt] upper edge of the visible part
    covers_top = hi >= c1  # [R,nq,A,nt]

    # Block region: q tile r meets key tile nt + r only.
    eye = torch.eye(nq, dtype=torch.bool, device=device).expand(R, nq, nq)  # [R,nq,nq]
    blk_full = eye if B == TILE else torch.zeros_like(eye)
    blk_partial = eye & ~blk_full

    out = []
    for w in windows:
        lo_any = lo if w is None else torch.maximum(lo, hi - w + 1)  # loosest row, k = 0
        lo_all = lo if w is None else torch.maximum(lo, hi + B - w)  # tightest row, k = B-1
        visited = (torch.maximum(lo_any, c0) < hi_cap).any(dim=2)  # [R,nq,nt]
        full = ((lo_all <= c0) & covers_top).all(dim=2)  # [R,nq,nt]
        partial = torch.cat([visited & ~full, blk_partial], dim=2)  # [R,nq,C]
        full = torch.cat([full, blk_full], dim=2)  # [R,nq,C]
        out.append((*_ordered(partial), *_ordered(full),
                    *_ordered(partial.transpose(1, 2)), *_ordered(full.transpose(1, 2))))
    return out


def build_block_mask(context_lo: torch.Tensor, context_hi: torch.Tensor, T: int, block_size: int,
                     window: int | None) -> BlockMask:
    """One flex BlockMask built directly from the ranges; see `build_block_masks` for the method.

    context_lo, context_hi: [R,N] int32 (anchors sorted). window: W or None (full attention).
    Returns a BlockMask over (Q, T+Q) with BLOCK_SIZE 128 and H = 1.
    Raises AssertionError when T % 128, Q % 128 or 128 % block_size is not 0 (the config refuses these first).
    Source: DFlash paper §4; `build_block_masks`.
    """
    return build_block_masks(context_lo, context_hi, T, block_size, [window])[window]
