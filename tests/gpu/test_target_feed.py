"""GPU-only: the co-located feed's side-stream target forward gives the same outputs as inline."""

import pytest
import torch

from dflash_trainer.target_model.features import TargetFeatureExtractor
from tests.tiny_targets import tiny_bundle
from dflash_trainer.training.feed import TargetFeed

pytestmark = pytest.mark.gpu


T = 256
POS = torch.cat([torch.arange(100), torch.arange(T - 100)])  # two documents per row


def _target_and_rows(n: int, seed: int):
    """A tiny Qwen3 on CUDA, its feature extractor (layers 0 and 2), and n random rows
    (input_ids / position_ids / loss_mask [T] each, two documents)."""
    target = tiny_bundle("qwen3", num_layers=4)
    target.model.to(torch.device("cuda"))
    g = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(3, 120, (T,), generator=g), "position_ids": POS.clone(), "loss_mask": POS >= 8}
            for _ in range(n)]
    return target, TargetFeatureExtractor(target, [0, 2]), rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_feed_matches_inline_forward():
    """Prevents a stream race (features read before the side stream wrote them, or memory reused early)."""
    dev = torch.device("cuda")
    _, extractor, rows = _target_and_rows(6, seed=0)
    batches = [{k: v[None] for k, v in r.items()} for r in rows]

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_feed_serves_later_epochs_equal_to_the_target():
    """Prevents a cache read racing its write on the side stream, or serving another row: 3 epochs of
    2-row batches over 4 rows (reshuffled), the cache sized for 3 rows (one row always recomputed,
    so mixed batches too); every batch equals the target's forward of its rows, and the target ran
    on 4 rows in epoch 1 and 1 row per epoch after."""
    from dflash_trainer.training.feature_cache import FeatureCache

    dev = torch.device("cuda")
    target, extractor, data = _target_and_rows(4, seed=1)
    order = [[0, 1], [2, 3], [3, 0], [1, 2], [2, 0], [3, 1]]
    batches = [{**{k: torch.stack([data[r][k] for r in rs]) for k in data[0]}, "row_index": torch.tensor(rs).numpy()}
               for rs in order]
    ran = []

    def forward(rows):
        torch.cuda._sleep(20_000_000)  # a late writer: a reader that did not wait would see garbage
        ran.append(rows["input_ids"].shape[0])
        return extractor(rows["input_ids"], rows["position_ids"])

    inline = [extractor(b["input_ids"].to(dev), b["position_ids"].to(dev)) for b in batches]
    per_row_bytes = T * (2 * target.hidden_size * 4 + 8)  # fp32 features of 2 layers + int64 labels
    feed = TargetFeed(forward, dev, overlap=True, cache=FeatureCache(3 * per_row_bytes + 1))
    got = [((out.features * 1).clone(), out.argmax.clone()) for _, out in feed(batches)]
    torch.cuda.synchronize()
    for (feats, argmax), ref in zip(got, inline):
        torch.testing.assert_close(feats, ref.features, rtol=1e-5, atol=1e-5)  # a 1-row forward may sum differently
        assert torch.equal(argmax, ref.argmax)
    assert feed.cache.stored_rows == 3 and sum(ran) == 4 + 2
