"""GPU-only: the co-located feed's side-stream target forward gives the same outputs as inline."""

import pytest
import torch

from dflash_trainer.target_model.features import TargetFeatureExtractor
from tests.tiny_targets import tiny_bundle
from dflash_trainer.training.feed import TargetFeed

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_feed_matches_inline_forward():
    """Prevents a stream race (features read before the side stream wrote them, or memory reused early)."""
    dev = torch.device("cuda")
    target = tiny_bundle("qwen3", num_layers=4)
    target.model.to(dev)
    extractor = TargetFeatureExtractor(target, [0, 2])
    g = torch.Generator().manual_seed(0)
    T = 256
    pos = torch.cat([torch.arange(100), torch.arange(T - 100)])[None]
    batches = [{"input_ids": torch.randint(3, 120, (1, T), generator=g), "position_ids": pos.clone(),
                "loss_mask": pos >= 8} for _ in range(6)]

    def forward(rows):
        return extractor(rows["input_ids"], rows["position_ids"])

    inline = [forward({k: v.to(dev) for k, v in b.items()}) for b in batches]

    def slow_forward(rows):
        # ~20 ms of sleep queued before the forward on the feed's stream: a reader on the main stream
        # that did not wait for the event would see the uninitialized feature buffer
        torch.cuda._sleep(20_000_000)
        return forward(rows)

    feed = TargetFeed(slow_forward, dev, overlap=True)
    assert feed.overlap
    got = []
    for rows, out in feed(batches):
        # read on the main stream right after the hand-over, as a drafter step would
        got.append((rows["input_ids"].clone(), (out.features * 1).clone(), out.argmax.clone()))
    torch.cuda.synchronize()
    assert len(got) == len(batches)
    for (ids, feats, argmax), ref, b in zip(got, inline, batches):
        assert torch.equal(ids.cpu(), b["input_ids"])
        torch.testing.assert_close(feats, ref.features, rtol=0, atol=0)
        assert torch.equal(argmax, ref.argmax)
