"""One target forward per document (`target_model/per_document.py`): spans, batching, scatter, and
the per-document forward against the packed forward of an attention-only target.

R = rows, T = packed tokens per row, H = hidden, k = target layers.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.target_model.per_document import document_batches, document_spans, group_spans, scatter
from tests.tiny_targets import tiny_bundle


def _positions(doc_lengths: list[int]) -> torch.Tensor:
    """[T] position ids restarting at 0 in each document."""
    return torch.cat([torch.arange(n) for n in doc_lengths])


def test_spans_cover_every_position_once():
    """Spans are the runs of equal document start (p − position_ids[p]): the documents of each row in
    order, the padding tail included, one-token documents kept; they cover every position once."""
    docs = [[5, 1, 7, 3], [16], [1, 1, 2, 12]]
    position_ids = torch.stack([_positions(d) for d in docs])
    spans = document_spans(position_ids)
    want = []
    for r, lengths in enumerate(docs):
        start = 0
        for n in lengths:
            want.append((r, start, n))
            start += n
    assert spans == want
    with pytest.raises(ValueError, match=r"must be \[R,T\]"):
        document_spans(position_ids[0])


def test_groups_respect_the_budget_and_keep_every_span():
    """Longest first; a group's padded size (count × its longest) stays within the budget, or holds one
    span longer than the budget alone; nothing is lost or repeated."""
    g = torch.Generator().manual_seed(0)
    spans = [(int(r), int(a), int(n)) for r, a, n in torch.randint(1, 90, (40, 3), generator=g)]
    groups = group_spans(spans, 100)
    assert sorted(s for grp in groups for s in grp) == sorted(spans)
    for grp in groups:
        lengths = [n for _, _, n in grp]
        assert lengths == sorted(lengths, reverse=True)
        assert len(grp) * lengths[0] <= 100 or len(grp) == 1
    assert [n for grp in groups for _, _, n in grp] == sorted((n for _, _, n in spans), reverse=True)


def test_batches_scatter_back_to_the_packed_layout():
    """Each document's tokens and own positions land in one padded batch row from column 0; scattering
    the batches' inputs back rebuilds the packed rows exactly (src/dst indices are a bijection)."""
    position_ids = torch.stack([_positions([5, 9, 2]), _positions([16])])
    input_ids = torch.arange(32).view(2, 16) + 100
    out = torch.full((2, 16, 2), -1)
    for b in document_batches(input_ids, position_ids):
        assert b.input_ids.shape == b.position_ids.shape and b.input_ids.shape[0] * b.input_ids.shape[1] <= 16
        both = torch.stack([b.input_ids, b.position_ids], dim=-1)  # [n,S,2]
        scatter(out, b, both)
    assert torch.equal(out[..., 0], input_ids)
    assert torch.equal(out[..., 1], position_ids)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_per_document_forward_equals_packed_forward(kind):
    """For an attention-only target the two realizations of the packed semantics agree: one forward
    per document (no mask) and one masked forward per row give the same features, final hidden
    states and labels, also when the layers after the last needed one are skipped. Prevents a
    scatter to the wrong positions or a shifted document."""
    bundle = tiny_bundle(kind, num_layers=4)
    g = torch.Generator().manual_seed(3)
    position_ids = torch.stack([_positions([7, 13, 1, 11]), _positions([32])])
    input_ids = torch.randint(3, bundle.vocab_size, (2, 32), generator=g)
    ex = TargetFeatureExtractor(bundle, [0, 2, 3], attention="sdpa")
    packed = ex(input_ids, position_ids, need_last_hidden=True)
    per_doc = ex.run_per_document(input_ids, position_ids, "sdpa", need_last_hidden=True)
    assert packed.features.abs().max() > 1.0
    torch.testing.assert_close(per_doc.features, packed.features, rtol=0, atol=1e-5)
    torch.testing.assert_close(per_doc.last_hidden, packed.last_hidden, rtol=0, atol=1e-5)
    assert torch.equal(per_doc.argmax, packed.argmax)
    short = ex.run_per_document(input_ids, position_ids, "sdpa", need_argmax=False)
    assert short.argmax is None and short.last_hidden is None
    torch.testing.assert_close(short.features, packed.features, rtol=0, atol=1e-5)
