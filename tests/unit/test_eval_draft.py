"""The drafter's inference path (cached context K/V, one block per round) against the training forward.

Shapes: L context positions, B block size, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from test_eval_common import target_and_drafter

from dflash_trainer.drafter.masks import build_dense_masks
from dflash_trainer.decoding.draft import DraftSession
from dflash_trainer.target_model.features import TargetFeatureExtractor

pytestmark = pytest.mark.usefixtures("one_thread")

def training_forward_logits(drafter, features, anchor_token, anchor_pos, B):
    """Slow reference: the training forward for one block at `anchor_pos` over all features [1,L,k·H]
    (context = positions < anchor, dense training mask), logits of slots 1..B−1."""
    cfg = drafter.config
    L = features.shape[1]
    lo = torch.zeros(1, 1, dtype=torch.int32)
    hi = torch.full((1, 1), anchor_pos, dtype=torch.int32)
    masks = build_dense_masks(lo, hi, L, B, cfg.attention_windows())
    ids = torch.full((1, B), cfg.mask_token_id, dtype=torch.long)
    ids[0, 0] = anchor_token
    bpos = torch.arange(anchor_pos, anchor_pos + B)[None]
    hidden = drafter(features, torch.arange(L)[None], ids, bpos, masks)  # [1,B,H]
    return (hidden[0, 1:] @ drafter.lm_head_weight.T).float()


@pytest.mark.parametrize("layer_types,window", [
    (("full_attention", "full_attention"), None),
    (("sliding_attention", "full_attention"), 5),
])
def test_cached_propose_equals_training_forward(layer_types, window):
    """The cached inference path is the trained model: a context projected once per position and
    reused (row 0 grown in uneven chunks, row 1 written once and longer) gives, for every row at its
    own anchor, the block logits of the training forward with the dense training mask, including
    the sliding-window rule (a+k) − p < W."""
    bundle, drafter = target_and_drafter("qwen3", layer_types=layer_types, sliding_window=window, block_size=4)
    ids = torch.randint(3, 120, (2, 23), generator=torch.Generator().manual_seed(0))
    extractor = TargetFeatureExtractor(bundle, drafter.config.target_layer_ids)
    feats = extractor(ids, torch.arange(23)[None].expand(2, 23)).features  # [2,23,k·H]
    sess = DraftSession(drafter, rows=2, max_len=30)
    sess.extend(feats[1:, :11], torch.tensor([0]), torch.tensor([1]))  # row 1: 11 positions
    done = 0
    for chunk in (7, 1, 5, 3, 6):
        sess.extend(feats[:1, done:done + chunk], torch.tensor([done]), torch.tensor([0]))
        done += chunk
        anchors = [done, 11]
        for B in (4, 2):  # trained B and a smaller inference B
            got = sess.propose(ids[torch.arange(2), torch.tensor(anchors) - 1], torch.tensor(anchors), max(anchors), B)
            for r, a in enumerate(anchors):
                want = training_forward_logits(drafter, feats[r:r + 1, :a], int(ids[r, a - 1]), a, B)
                torch.testing.assert_close(got[r], want, atol=2e-5, rtol=2e-5)


def test_zero_features_matches_training_with_zeros():
    """A control drafter (trained on zeroed features) is served with zeroed features too."""
    bundle, drafter = target_and_drafter()
    feats = torch.randn(1, 9, 2 * bundle.hidden_size)
    sess = DraftSession(drafter, rows=1, max_len=16, zero_features=True)
    sess.extend(feats, torch.tensor([0]))
    got = sess.propose(torch.tensor([5]), torch.tensor([9]), 9)[0]
    want = training_forward_logits(drafter, torch.zeros_like(feats), 5, 9, 4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_propose_refuses_larger_blocks():
    """A drafter never saw slots beyond its trained block size."""
    bundle, drafter = target_and_drafter()
    sess = DraftSession(drafter, rows=1, max_len=16)
    sess.extend(torch.randn(1, 5, 2 * bundle.hidden_size), torch.tensor([0]))
    with pytest.raises(ValueError, match="block_size=5"):
        sess.propose(torch.tensor([3]), torch.tensor([5]), 5, 5)
