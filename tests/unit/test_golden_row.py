"""The hand-worked packed row in tests/assets/tiny_row.json, reproduced exactly.

Two documents (positions 0–6 and 7–11), B = 4, W = 3, γ = 4, anchors [3, 5, 9] plus one
invalid (padded) anchor. Covers anchor validity, block inputs/positions/labels/weights and both
visibility matrices of the dense realization.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_trainer.drafter.anchors import valid_anchor_positions
from dflash_trainer.drafter.blocks import build_blocks
from dflash_trainer.drafter.masks import dense_mask

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "assets" / "tiny_row.json"
MASK = 999  # mask token id used for the row (the file writes "MASK")
PAD_ANCHOR = 0  # the invalid anchor's position; any position works with anchor_valid False


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN_PATH.read_text())


@pytest.fixture(scope="module")
def row(golden):
    ids = torch.tensor([golden["tokens"]])
    lm = torch.tensor([golden["supervised"]], dtype=torch.bool)
    pos = torch.tensor([golden["position_ids"]])
    argmax = torch.tensor([golden["target_argmax"]])
    anchors = torch.tensor([[PAD_ANCHOR if a is None else a for a in golden["anchors"]]])
    valid = torch.tensor([[a is not None for a in golden["anchors"]]])
    return ids, lm, pos, argmax, anchors, valid


def _blocks(golden, row, label_source):
    ids, lm, pos, argmax, anchors, valid = row
    return build_blocks(ids, lm, pos, anchors, valid, block_size=golden["block_size"], mask_token_id=MASK,
                        gamma=golden["gamma"], label_source=label_source, target_argmax=argmax)


def test_valid_anchor_positions(golden, row):
    """Prevents anchors whose next token is in another document or unsupervised (e.g. 6 → 7)."""
    ids, lm, pos, *_ = row
    valid = valid_anchor_positions(lm, pos)[0]
    assert [i for i, v in enumerate(valid.tolist()) if v] == golden["valid_anchor_positions"]


def test_block_inputs_positions_and_valid_slots(golden, row):
    """Prevents wrong block tokens (anchor then MASK), positions not restarting per document,
    and slots crossing a document boundary being trained."""
    bl = _blocks(golden, row, "data")
    B = golden["block_size"]
    for j, blk in enumerate(golden["blocks"]):
        assert bl.anchor_valid[0, j].item() == (blk["anchor"] is not None)
        for s in blk["slots"]:
            q = j * B + s["k"]
            assert bl.slot_valid[0, q].item() is s["valid"], (j, s)
            if "input_token" in s:
                expect = MASK if s["input_token"] == "MASK" else s["input_token"]
                assert bl.block_input_ids[0, q].item() == expect, (j, s)
                assert bl.block_position_ids[0, q].item() == s["position_id"], (j, s)
    assert bl.block_input_ids.dtype == torch.int64 and bl.block_position_ids.dtype == torch.int64


def test_labels_both_kinds_and_weights(golden, row):
    """Prevents the EAGLE-style label shift (data label must be token a+k; target label the
    target's argmax at a+k-1) and a wrong decay exp(-(k-1)/γ) or weight on invalid slots."""
    data = _blocks(golden, row, "data")
    target = _blocks(golden, row, "target")
    B = golden["block_size"]
    for j, blk in enumerate(golden["blocks"]):
        for s in blk["slots"]:
            q = j * B + s["k"]
            if s["valid"]:
                assert data.labels[0, q].item() == s["label_data"], (j, s)
                assert target.labels[0, q].item() == s["label_target"], (j, s)
                assert data.loss_weight[0, q].item() == pytest.approx(s["weight"], abs=1e-6)
                assert target.loss_weight[0, q].item() == pytest.approx(s["weight"], abs=1e-6)
            else:
                assert data.loss_weight[0, q].item() == 0.0 and target.loss_weight[0, q].item() == 0.0
                assert data.labels[0, q].item() == 0 and target.labels[0, q].item() == 0
    assert data.loss_weight.dtype == torch.float32 and data.labels.dtype == torch.int64


def test_context_ranges(golden, row):
    """Prevents context ranges reaching into the previous document or past the anchor, and
    invalid anchors getting any context."""
    bl = _blocks(golden, row, "data")
    for j, blk in enumerate(golden["blocks"]):
        lo, hi = bl.context_lo[0, j].item(), bl.context_hi[0, j].item()
        assert list(range(lo, hi)) == blk["context_full"], j
    assert bl.context_lo.dtype == torch.int32 and bl.context_hi.dtype == torch.int32


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_visibility_matrices(golden, row, kind):
    """Prevents any drift of the dense mask from the hand-worked matrices (future context,
    another block, the window's far edge off by up to B-1)."""
    bl = _blocks(golden, row, "data")
    window = None if kind == "full" else golden["sliding_window"]
    m = dense_mask(bl.context_lo, bl.context_hi, golden["T"], golden["block_size"], window)[0]
    got = ["".join("1" if v else "0" for v in r) for r in m.tolist()]
    assert got == golden[f"visibility_{kind}"]


def test_sliding_context_per_slot(golden, row):
    """Prevents the block-wide window approximation (p >= a - W for every slot)."""
    bl = _blocks(golden, row, "data")
    T, B, W = golden["T"], golden["block_size"], golden["sliding_window"]
    m = dense_mask(bl.context_lo, bl.context_hi, T, B, W)[0]
    for j, blk in enumerate(golden["blocks"]):
        for s in blk["slots"]:
            if "context_sliding" in s:
                seen = [p for p in range(T) if m[j * B + s["k"], p]]
                assert seen == s["context_sliding"], (j, s)
