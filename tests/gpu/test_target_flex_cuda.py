"""GPU-only: the target's flex path on CUDA in bf16 — same features and labels as the SDPA path,
and no host synchronization in the mask build or the whole forward.

Model: a small random Qwen3 (4 layers, H 256, 8/2 heads, head_dim 32, vocab 1024) with sliding and
full layers alternating (W = 300), 2 packed rows of 1024 tokens in documents that cross tile edges.
"""

import pytest
import torch

from dflash_trainer.target_model.attention import attention_masks_for
from dflash_trainer.target_model.features import TargetFeatureExtractor
from tests.tiny_targets import bundle_from_model, tiny_qwen3

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
T = 1024


def _rows(dev):
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ([300, 500, 24, 200], [1024])])
    ids = torch.randint(3, 1024, (2, T), generator=torch.Generator().manual_seed(0))
    return ids.to(dev), pos.to(dev)


def _bundle(dev, dtype):
    model = tiny_qwen3(num_layers=4, hidden=256, num_heads=8, num_kv_heads=2, head_dim=32, intermediate=512,
                       vocab_size=1024, sliding_window=300,
                       layer_types=["sliding_attention", "full_attention"] * 2, seed=0)
    return bundle_from_model(model.to(dev, dtype))


@needs_cuda
def test_flex_features_equal_sdpa_features_in_bf16():
    """Prevents the fast path from training the drafter on other features than the dense-mask path.

    bf16 on both paths differs from an fp32 forward by kernel rounding only. The flex path runs
    compiled layers (the CUDA default) and, checked alike, eager ones. Tolerances: the flex
    bf16 features are no farther from the fp32 features than 3× the SDPA bf16 ones (+1e-3 of their
    scale), and within 5e-2 (relative to max |feature|) of the SDPA bf16 features; greedy labels
    agree with the fp32 labels at least as often as the SDPA bf16 ones, minus 1 % (near-ties flip).
    """
    dev = torch.device("cuda")
    ids, pos = _rows(dev)
    layer_ids = [0, 1, 2, 3]
    ref32 = TargetFeatureExtractor(_bundle(dev, torch.float32), layer_ids, attention="sdpa")(ids, pos)
    b16 = _bundle(dev, torch.bfloat16)
    sdpa = TargetFeatureExtractor(b16, layer_ids, attention="sdpa")(ids, pos)
    ex = TargetFeatureExtractor(b16, layer_ids, attention="auto")
    assert ex.implementation_for(T) == "flex" and ex.compiles("flex")  # the training default: compiled layers
    flex = ex(ids, pos)
    eager = TargetFeatureExtractor(b16, layer_ids, attention="flex", compile_layers=False)(ids, pos)
    scale = ref32.features.abs().max()
    err_sdpa = (sdpa.features.float() - ref32.features).abs().max()
    err_flex = (flex.features.float() - ref32.features).abs().max()
    assert err_flex <= 3 * err_sdpa + 1e-3 * scale, (float(err_flex), float(err_sdpa), float(scale))
    assert (flex.features.float() - sdpa.features.float()).abs().max() / scale < 5e-2
    agree_sdpa = (sdpa.argmax == ref32.argmax).float().mean()
    agree_flex = (flex.argmax == ref32.argmax).float().mean()
    assert agree_flex >= agree_sdpa - 0.01, (float(agree_flex), float(agree_sdpa))
    err_eager = (eager.features.float() - ref32.features).abs().max()  # eager flex layers: the same bound
    assert err_eager <= 3 * err_sdpa + 1e-3 * scale, (float(err_eager), float(err_sdpa), float(scale))
    assert (eager.argmax == ref32.argmax).float().mean() >= agree_sdpa - 0.01
    assert b16.config._attn_implementation == "sdpa"


@needs_cuda
def test_block_mask_build_and_flex_forward_have_no_host_sync():
    """Prevents the target forward from stalling the GPU: the BlockMask build (both windows) and the
    whole flex forward with labels run under torch.cuda.set_sync_debug_mode("error")."""
    dev = torch.device("cuda")
    ids, pos = _rows(dev)
    bundle = _bundle(dev, torch.bfloat16)
    ex = TargetFeatureExtractor(bundle, [0, 2], attention="flex")
    for _ in range(2):  # compile flex and allocate outside the checked region
        ex(ids, pos)
        attention_masks_for(bundle.config, pos, "flex")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masks = attention_masks_for(bundle.config, pos, "flex")
        out = ex(ids, pos)
        out_short = ex(ids, pos, need_argmax=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert out.argmax.shape == (2, T) and out_short.argmax is None
    assert torch.isfinite(out.features.float()).all().item()
