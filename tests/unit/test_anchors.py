"""Anchor validity and device-side anchor sampling (drafter/anchors.py)."""

from __future__ import annotations

import pytest
import torch

from tests.sync_guard import SyncGuard

from dflash_trainer.drafter.anchors import sample_anchors, valid_anchor_positions
from dflash_trainer.drafter.blocks import build_blocks


def _packed(doc_lens: list[int], pad: int, supervised_from: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row: documents supervised from `supervised_from` on, then a padding pseudo-document."""
    pos, lm = [], []
    for n in doc_lens:
        pos += list(range(n))
        lm += [0] * min(supervised_from, n) + [1] * max(0, n - supervised_from)
    pos += list(range(pad))
    lm += [0] * pad
    return torch.tensor([lm], dtype=torch.bool), torch.tensor([pos])


def _valid_brute(lm: list[int], pos: list[int]) -> list[bool]:
    T = len(lm)
    return [a + 1 < T and bool(lm[a]) and bool(lm[a + 1]) and pos[a + 1] == pos[a] + 1 for a in range(T)]


def test_valid_positions_match_definition():
    """Prevents anchors at a document's last token, before unsupervised tokens, or at T-1."""
    g = torch.Generator().manual_seed(0)
    lm = torch.rand(3, 50, generator=g) < 0.7
    lm[2] = True  # fully supervised row: only document ends and T-1 are invalid
    pos = torch.cat([torch.arange(20), torch.arange(17), torch.arange(13)]).expand(3, 50)
    got = valid_anchor_positions(lm, pos)
    assert got.dtype == torch.bool and got.shape == (3, 50)
    for r in range(3):
        assert got[r].tolist() == _valid_brute(lm[r].int().tolist(), pos[r].tolist())
    assert not got[:, -1].any()
    assert [a for a in range(50) if not got[2, a]] == [19, 36, 49]
    # integer loss masks behave like bool ones
    assert torch.equal(valid_anchor_positions(lm.to(torch.int8), pos.int()), got)


def test_all_anchors_valid_sorted_and_distinct_when_enough():
    """Prevents unsorted anchors (slow flex tiles), duplicates, or picks on invalid positions."""
    lm, pos = _packed([60, 45, 70], pad=25)
    lm, pos = lm.expand(4, -1), pos.expand(4, -1)
    valid = valid_anchor_positions(lm, pos)
    g = torch.Generator().manual_seed(1)
    anchors, ok = sample_anchors(lm, pos, 32, g)
    assert anchors.shape == (4, 32) and anchors.dtype == torch.int64 and ok.dtype == torch.bool
    assert ok.all()
    assert (anchors[:, 1:] > anchors[:, :-1]).all()  # strictly ascending ⇒ distinct
    assert valid.gather(1, anchors).all()
    assert not torch.equal(anchors[0], anchors[1])  # rows draw independently


def test_too_few_valid_positions_flags_the_rest():
    """Prevents silently training on invalid anchors when a row has fewer valid positions than N."""
    lm, pos = _packed([8, 6], pad=30)  # valid: 1..6 and 9..12 → 10 positions
    valid = valid_anchor_positions(lm, pos)[0]
    expect = [a for a in range(44) if valid[a]]
    assert len(expect) == 10
    anchors, ok = sample_anchors(lm, pos, 16, torch.Generator().manual_seed(2))
    assert ok.sum().item() == 10
    assert anchors[ok].tolist() == expect  # every valid position is taken
    assert not valid[anchors[~ok]].any()  # the extra picks sit on invalid positions ...
    assert (anchors[0, 1:] > anchors[0, :-1]).all()  # ... and are sorted among the others


def test_no_valid_positions_at_all():
    """Prevents crashes or valid flags on an all-padding row."""
    lm = torch.zeros(2, 20, dtype=torch.bool)
    pos = torch.arange(20).expand(2, 20)
    anchors, ok = sample_anchors(lm, pos, 20, None)
    assert not ok.any()
    assert anchors[0].tolist() == list(range(20))


def test_num_anchors_larger_than_row_raises():
    """Prevents an opaque topk error when num_anchors exceeds T."""
    lm, pos = _packed([10], pad=0)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(lm, pos, 11, None)


def test_generator_makes_draws_reproducible():
    """Prevents anchors that ignore the seeded generator (irreproducible runs)."""
    lm, pos = _packed([100, 50], pad=6)
    a1, _ = sample_anchors(lm, pos, 16, torch.Generator().manual_seed(7))
    a2, _ = sample_anchors(lm, pos, 16, torch.Generator().manual_seed(7))
    a3, _ = sample_anchors(lm, pos, 16, torch.Generator().manual_seed(8))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)


def test_per_document_quota_covers_every_document():
    """Prevents short documents from getting no anchor when the quota is requested."""
    docs = [200, 4, 5, 3, 150, 6, 4]  # short documents hold 1–4 valid positions each
    lm, pos = _packed(docs, pad=28)
    R = 64
    lm, pos = lm.expand(R, -1), pos.expand(R, -1)
    starts, s = [], 0
    for n in docs:
        starts.append(s)
        s += n
    doc_of = torch.bucketize(torch.arange(lm.shape[1]), torch.tensor(starts), right=True) - 1
    N = len(docs)  # exactly one anchor per document is possible
    anchors, ok = sample_anchors(lm, pos, N, torch.Generator().manual_seed(3), per_document_quota=True)
    assert ok.all()
    for r in range(R):
        assert sorted(set(doc_of[anchors[r]].tolist())) == list(range(len(docs))), r
    # Without the quota the short documents are usually missed (shows the test can fail).
    plain, _ = sample_anchors(lm, pos, N, torch.Generator().manual_seed(3))
    covered = [len(set(doc_of[plain[r]].tolist())) == len(docs) for r in range(R)]
    assert not all(covered)


def test_per_document_quota_with_more_anchors_stays_valid_and_sorted():
    """Prevents the quota boost from picking invalid positions or breaking the sort."""
    lm, pos = _packed([30, 3, 40, 2], pad=10)  # the 2-token document has no valid position
    anchors, ok = sample_anchors(lm, pos, 20, torch.Generator().manual_seed(4), per_document_quota=True)
    valid = valid_anchor_positions(lm, pos)
    assert ok.all() and valid.gather(1, anchors).all()
    assert (anchors[:, 1:] > anchors[:, :-1]).all()
    assert ((anchors >= 30) & (anchors < 33)).any()  # the 3-token document got its one position


def test_sampling_is_uniform_over_valid_positions():
    """Prevents biased anchors (e.g. favoring early positions or long documents): chi-square
    test of how often each valid position is picked over many independent rows."""
    stats = pytest.importorskip("scipy.stats")
    lm, pos = _packed([25, 9, 30], pad=8)
    valid = valid_anchor_positions(lm, pos)[0]
    R, N = 6000, 6
    anchors, ok = sample_anchors(lm.expand(R, -1), pos.expand(R, -1), N, torch.Generator().manual_seed(5))
    assert ok.all()
    counts = torch.bincount(anchors.flatten(), minlength=lm.shape[1]).double()
    assert counts[~valid].sum().item() == 0
    observed = counts[valid]
    expected = torch.full_like(observed, R * N / observed.numel())
    result = stats.chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, result


def test_sampler_and_blocks_avoid_host_syncs_cpu():
    """Prevents a host sync (.item, nonzero, boolean indexing) creeping into the per-step
    sampler and block layout, which would stall the GPU pipeline every step."""
    lm, pos = _packed([40, 30, 50], pad=8)
    lm, pos = lm.expand(2, -1).contiguous(), pos.expand(2, -1).contiguous()
    ids = torch.randint(0, 100, lm.shape)
    with SyncGuard():
        anchors, ok = sample_anchors(lm, pos, 16, torch.Generator().manual_seed(6), per_document_quota=True)
        build_blocks(ids, lm, pos, anchors, ok, block_size=4, mask_token_id=7, gamma=4.0,
                     label_source="target", target_argmax=ids)
    with pytest.raises(AssertionError, match="host sync"), SyncGuard():
        ok.any().item()  # the guard itself works


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_and_blocks_avoid_host_syncs_cuda():
    """Prevents device→host syncs in sampling and block layout on CUDA (sync debug mode)."""
    lm, pos = _packed([300, 200, 400], pad=124)
    lm, pos = lm.expand(2, -1).cuda(), pos.expand(2, -1).cuda()
    ids = torch.randint(0, 100, lm.shape, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        anchors, ok = sample_anchors(lm, pos, 64, g, per_document_quota=True)
        blocks = build_blocks(ids, lm, pos, anchors, ok, block_size=16, mask_token_id=7, gamma=7.0,
                              label_source="target", target_argmax=ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ok.all().item() and blocks.labels.is_cuda
