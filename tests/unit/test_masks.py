"""Visibility of the draft blocks: dense mask, reference mask_mod and the direct BlockMask.

Every realization is checked against an obvious pure-Python loop written from the definition
(docs/architecture.md, "Semantics"): slot k of the block of anchor a sees context p iff p is in a's document and
p < a (and a + k − p < W on sliding layers), plus its own whole block; never another block.
"""

from __future__ import annotations

import pytest
import torch

from tests.sync_guard import SyncGuard
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from dflash_trainer.drafter.anchors import sample_anchors
from dflash_trainer.drafter.blocks import build_blocks
from dflash_trainer.drafter.masks import (
    build_block_mask,
    build_block_masks,
    build_dense_masks,
    dense_mask,
    reference_mask_mod,
)

BM_FIELDS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]


def _row(T: int, g: torch.Generator, supervised_p: float, max_doc: int) -> tuple[list[int], list[int], list[int]]:
    """Random packed row: documents of random length, then a padding pseudo-document.

    Returns (position_ids, loss_mask, document index of each position)."""
    pos, lm, doc = [], [], []
    pad = int(torch.randint(0, T // 4, (1,), generator=g))
    d = 0
    while len(pos) < T - pad:
        n = min(int(torch.randint(1, max_doc + 1, (1,), generator=g)), T - pad - len(pos))
        pos += list(range(n))
        lm += [0] + [int(torch.rand(1, generator=g) < supervised_p) for _ in range(n - 1)]
        doc += [d] * n
        d += 1
    pos += list(range(pad))
    lm += [0] * pad
    doc += [d] * pad
    return pos, lm, doc


def _layout(R: int, T: int, N: int, B: int, seed: int, supervised_p=(0.9, 0.05), max_doc=None):
    """Rows → sampled anchors (some invalid when a row is sparse) → blocks."""
    g = torch.Generator().manual_seed(seed)
    rows = [_row(T, g, supervised_p[r % len(supervised_p)], max_doc or T) for r in range(R)]
    pos = torch.tensor([r[0] for r in rows])
    lm = torch.tensor([r[1] for r in rows], dtype=torch.bool)
    doc = [r[2] for r in rows]
    ids = torch.randint(0, 1000, (R, T), generator=g)
    anchors, ok = sample_anchors(lm, pos, N, g)
    blocks = build_blocks(ids, lm, pos, anchors, ok, block_size=B, mask_token_id=5, gamma=4.0,
                          label_source="data", target_argmax=None)
    return blocks, doc


def _brute(anchors: list[list[int]], valid: list[list[bool]], doc: list[list[int]], T: int, B: int,
           window: int | None) -> torch.Tensor:
    """The definition, one (query, key) pair at a time."""
    R, N = len(anchors), len(anchors[0])
    Q = N * B
    out = torch.zeros(R, Q, T + Q, dtype=torch.bool)
    for r in range(R):
        for j in range(N):
            a = anchors[r][j]
            for k in range(B):
                q = j * B + k
                for p in range(T):
                    sees = valid[r][j] and doc[r][p] == doc[r][a] and p < a
                    if window is not None:
                        sees = sees and (a + k) - p < window
                    out[r, q, p] = sees
                for i in range(Q):
                    out[r, q, T + i] = i // B == j
    return out


@pytest.mark.parametrize("B", [4, 8, 16])
@pytest.mark.parametrize("window", [None, 1, 3, 11])
def test_dense_mask_matches_brute_force(B, window):
    """Prevents any drift of the vectorized dense mask from the definition: context of another
    document, context at/after the anchor, invalid anchors seeing context, the sliding window
    off by one or applied block-wide, other blocks visible."""
    T, N = 48, 10  # 10 anchors on 48 tokens: blocks overlap heavily
    blocks, doc = _layout(2, T, N, B, seed=B * 100 + (window or 0), supervised_p=(0.9, 0.08), max_doc=20)
    ok = blocks.anchor_valid
    assert ok[0].all() and not ok[1].all()  # the sparse row has invalid anchors
    got = dense_mask(blocks.context_lo, blocks.context_hi, T, B, window)
    assert got.dtype == torch.bool and got.shape == (2, N * B, T + N * B)
    want = _brute(blocks.anchors.tolist(), ok.tolist(), doc, T, B, window)
    assert torch.equal(got, want)


def test_dense_mask_handmade_overlapping_and_invalid_anchors():
    """Prevents a block-id rule leaking a later anchor's context into an earlier overlapping
    block (SpecForge #470 style), and invalid anchors seeing anything but their own block."""
    T, B = 16, 4
    pos = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 0, 1]  # docs [0,10), [10,14), padding [14,16)
    doc = [0] * 10 + [1] * 4 + [2] * 2
    anchors = [[2, 3, 4, 11, 0]]  # 2/3/4 overlap; the last is invalid
    valid = [[True, True, True, True, False]]
    lo = torch.tensor([[p - pos[p] if v else 0 for p, v in zip(anchors[0], valid[0])]], dtype=torch.int32)
    hi = torch.tensor([[p if v else 0 for p, v in zip(anchors[0], valid[0])]], dtype=torch.int32)
    for w in (None, 2):
        got = dense_mask(lo, hi, T, B, w)
        assert torch.equal(got, _brute(anchors, valid, [doc], T, B, w))
    m = dense_mask(lo, hi, T, B, None)[0]
    assert m[0:B, 2:T].sum() == 0  # anchor 2 never sees 2.. (incl. anchors 3, 4 of later blocks)
    assert m[3 * B:4 * B, :10].sum() == 0 and m[3 * B:4 * B, 10].all()  # anchor 11: only position 10
    assert m[4 * B:, :T].sum() == 0 and m[4 * B:, T + 4 * B:].all()  # invalid: own block only


@pytest.mark.parametrize("window", [None, 5])
def test_no_query_sees_its_anchor_or_later_or_another_block(window):
    """Prevents future leakage: no query sees a context key at or after its anchor, and no query
    sees another block's keys (property over random layouts)."""
    T, N, B = 64, 16, 8
    blocks, _ = _layout(3, T, N, B, seed=11, supervised_p=(0.9, 0.5, 0.05), max_doc=30)
    m = dense_mask(blocks.context_lo, blocks.context_hi, T, B, window)  # [R,Q,K]
    a = blocks.anchors.repeat_interleave(B, dim=1)  # [R,Q] anchor of each query
    p = torch.arange(T)
    assert not (m[:, :, :T] & (p >= a[:, :, None])).any()
    j = torch.arange(N * B) // B
    other_block = j[:, None] != j[None, :]
    assert not (m[:, :, T:] & other_block).any()
    assert m[:, :, T:][:, ~other_block].all()  # own block: bidirectional


def test_reference_mask_mod_equals_dense_mask():
    """Prevents the flex mask_mod and the dense SDPA mask from disagreeing (CUDA and CPU
    training would then train different models)."""
    T, N, B = 40, 6, 8
    blocks, _ = _layout(2, T, N, B, seed=3, max_doc=15)
    for w in (None, 4):
        mod = reference_mask_mod(blocks.context_lo, blocks.context_hi, T, B, w)
        ref = create_mask(mod, 2, 1, N * B, T + N * B, device="cpu")
        assert torch.equal(ref[:, 0], dense_mask(blocks.context_lo, blocks.context_hi, T, B, w))


def test_build_dense_masks_dict_shares_one_definition():
    """Prevents the multi-window builder from diverging from dense_mask or missing the head axis
    SDPA needs to broadcast over heads ([R,1,Q,K], not [R,Q,K] broadcast against heads)."""
    T, N, B = 40, 6, 8
    blocks, _ = _layout(2, T, N, B, seed=4, max_doc=15)
    masks = build_dense_masks(blocks.context_lo, blocks.context_hi, T, B, [None, 7, None])
    assert list(masks) == [None, 7]
    for w, m in masks.items():
        assert m.shape == (2, 1, N * B, T + N * B)
        assert torch.equal(m[:, 0], dense_mask(blocks.context_lo, blocks.context_hi, T, B, w))


def _assert_same_block_mask(got, ref):
    assert got.seq_lengths == ref.seq_lengths and got.BLOCK_SIZE == ref.BLOCK_SIZE
    for f in BM_FIELDS:
        x, y = getattr(got, f), getattr(ref, f)
        assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous(), f
        assert torch.equal(x, y), f


# (T, N, B): Q = N·B multiple of 128; long documents give full context tiles, B = 128 a full block tile.
FLEX_CASES = [(256, 16, 8), (512, 32, 8), (256, 8, 16), (512, 16, 16), (256, 2, 128)]


@pytest.mark.parametrize("T,N,B", FLEX_CASES)
@pytest.mark.parametrize("window", [None, 3, 40, 200])
def test_direct_block_mask_is_bit_identical_to_create_block_mask(T, N, B, window):
    """Prevents the directly built BlockMask from differing from torch's own construction in any
    table (wrong partial/full split, index order, or transposed q-side tables used by backward)."""
    blocks, _ = _layout(2, T, N, B, seed=T + N + B + (window or 0), supervised_p=(0.9, 0.1), max_doc=T // 2)
    lo, hi = blocks.context_lo, blocks.context_hi
    Q = N * B
    got = build_block_mask(lo, hi, T, B, window)
    ref = create_block_mask(reference_mask_mod(lo, hi, T, B, window), 2, 1, Q, T + Q, device="cpu")
    _assert_same_block_mask(got, ref)


def _long_document(T: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranges of N anchors late in one long document (context from 0): many full context tiles."""
    a = torch.linspace(300, T - 12, N).long()[None]
    return torch.zeros(1, N, dtype=torch.int32), a.int()


def test_direct_block_mask_full_context_tiles_are_exercised():
    """Prevents the comparison above from passing vacuously: a long document must yield full
    context tiles, and a sliding window must shrink or remove them."""
    T, N, B = 512, 16, 8
    lo, hi = _long_document(T, N)
    for w, num_full in ((None, 2), (450, 1), (20, 0)):
        got = build_block_mask(lo, hi, T, B, w)
        ref = create_block_mask(reference_mask_mod(lo, hi, T, B, w), 1, 1, N * B, T + N * B, device="cpu")
        _assert_same_block_mask(got, ref)
        assert got.full_kv_num_blocks.flatten().tolist() == [num_full]


def test_build_block_masks_one_pass_matches_single_builds():
    """Prevents the shared multi-window pass from mixing up windows (full vs sliding edges)."""
    T, N, B = 256, 16, 16
    blocks, _ = _layout(2, T, N, B, seed=9, max_doc=200)
    cases = [(blocks.context_lo, blocks.context_hi, T, N, B), (*_long_document(512, 16), 512, 16, 8)]
    for lo, hi, T, N, B in cases:
        masks = build_block_masks(lo, hi, T, B, [None, 64, 64])
        assert list(masks) == [None, 64]
        for w, bm in masks.items():
            _assert_same_block_mask(bm, build_block_mask(lo, hi, T, B, w))
    assert masks[None].full_kv_num_blocks.sum() > masks[64].full_kv_num_blocks.sum()


def test_direct_block_mask_fuzz_ranges():
    """Prevents edge errors of the tile classification (ranges ending exactly on a tile edge,
    windows near the edge, empty and invalid ranges) by fuzzing raw ranges against torch."""
    g = torch.Generator().manual_seed(123)
    full_seen = 0
    for it in range(24):
        T, B = (256, 8) if it % 2 else (384, 16)
        N = 256 // B
        low_end = 0 if it % 2 else T // 2  # late anchors give full tiles
        hi = torch.sort(torch.randint(low_end, T + 1, (2, N), generator=g), dim=1).values
        if it % 3 == 0:  # snap some ends onto tile edges
            hi = torch.where(torch.rand(2, N, generator=g) < 0.5, hi // 128 * 128, hi)
        # 1–3 documents per row (starts include 0, sometimes a tile edge): lo = start of hi's document
        starts = torch.randint(0, T, (2, 3), generator=g) * (torch.rand(2, 3, generator=g) < 0.5)
        starts[:, 1] = torch.where(torch.rand(2, generator=g) < 0.3, 128, starts[:, 1])
        below = starts[:, None, :] <= (hi[:, :, None] - 1).clamp(min=0)  # [2,N,3]
        lo = torch.where(below, starts[:, None, :], 0).amax(dim=2)
        invalid = torch.rand(2, N, generator=g) < (0.2 if it % 3 == 1 else 0.0)
        lo, hi = torch.where(invalid, 0, lo).int(), torch.where(invalid, 0, hi).int()
        window = None if it % 4 == 0 else int(torch.randint(1, T, (1,), generator=g))
        got = build_block_mask(lo, hi, T, B, window)
        ref = create_block_mask(reference_mask_mod(lo, hi, T, B, window), 2, 1, N * B, T + N * B, device="cpu")
        _assert_same_block_mask(got, ref)
        full_seen += int(got.full_kv_num_blocks.sum())
    assert full_seen > 0


@pytest.mark.parametrize("bad", [(200, 16, 8), (256, 10, 8), (256, 16, 24)])
def test_block_mask_rejects_untileable_shapes(bad):
    """Prevents silently wrong masks for shapes the 128-tile construction cannot express: the
    builder asserts (the config refuses these shapes first, naming the field:
    tests/unit/test_drafter_shape_rules.py)."""
    T, N, B = bad
    lo = torch.zeros(1, N, dtype=torch.int32)
    with pytest.raises(AssertionError, match="flex tiles"):
        build_block_mask(lo, lo, T, B, None)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 24])
def test_flex_forward_equals_sdpa_with_dense_mask(window):
    """Prevents the CUDA path (flex + direct BlockMask) and the CPU path (SDPA + dense mask) from
    computing different attention for the same batch."""
    T, N, B = 256, 16, 8
    R, Hq, Hkv, D = 2, 4, 2, 16
    blocks, _ = _layout(R, T, N, B, seed=21, supervised_p=(0.9, 0.1), max_doc=180)
    lo, hi = blocks.context_lo, blocks.context_hi
    Q, K = N * B, T + N * B
    g = torch.Generator().manual_seed(0)
    q = torch.randn(R, Hq, Q, D, generator=g)
    k = torch.randn(R, Hkv, K, D, generator=g)
    v = torch.randn(R, Hkv, K, D, generator=g)
    out_flex = flex_attention(q, k, v, block_mask=build_block_mask(lo, hi, T, B, window), enable_gqa=True)
    mask = build_dense_masks(lo, hi, T, B, [window])[window]  # [R,1,Q,K]
    out_sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)


def test_mask_builders_avoid_host_syncs_cpu():
    """Prevents a host sync in the per-step mask builders (would stall every CUDA step)."""
    T, N, B = 256, 16, 8
    blocks, _ = _layout(2, T, N, B, seed=5, max_doc=200)
    with SyncGuard():
        build_block_masks(blocks.context_lo, blocks.context_hi, T, B, [None, 32])
        build_dense_masks(blocks.context_lo, blocks.context_hi, T, B, [None, 32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 100])
def test_direct_block_mask_on_cuda_no_sync_and_identical(window):
    """Prevents device→host syncs in the CUDA mask build, and CUDA/CPU table mismatches."""
    T, N, B = 1024, 64, 16
    blocks, _ = _layout(2, T, N, B, seed=17, max_doc=600)
    lo, hi = blocks.context_lo.cuda(), blocks.context_hi.cuda()
    build_block_masks(lo, hi, T, B, [window])  # first call compiles the table kernels (compilation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = build_block_masks(lo, hi, T, B, [window])[window]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = create_block_mask(reference_mask_mod(lo, hi, T, B, window), 2, 1, N * B, T + N * B, device="cuda")
    _assert_same_block_mask(got, ref)
