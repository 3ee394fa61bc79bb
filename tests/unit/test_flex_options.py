"""The measured flex tiles reach flex attention only where they were measured (sm90, head_dim 128, bf16,
at least 128 block queries)."""

import pytest
import torch

from dflash_trainer.drafter import layers
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.layers import SM90_D128_FLEX_OPTIONS, DrafterAttention, tuned_flex_options
from dflash_trainer.drafter.masks import build_block_mask


@pytest.mark.parametrize("capability, head_dim, expect", [((9, 0), 128, True), ((9, 0), 64, False),
                                                          ((8, 0), 128, False), ((10, 0), 128, False)])
def test_only_sm90_head_dim_128_gets_the_tiles(monkeypatch, capability, head_dim, expect):
    """Prevents tiles measured on an H200 being forced on other GPUs or head dims (shared-memory limits)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got = tuned_flex_options(head_dim, torch.device("cuda", 0))
    assert got == (SM90_D128_FLEX_OPTIONS if expect else None)
    assert tuned_flex_options(head_dim, torch.device("cpu")) is None


@pytest.mark.parametrize("dtype, anchors, expect", [(torch.bfloat16, 16, True), (torch.float32, 16, False),
                                                    (torch.bfloat16, 8, False)])
def test_attention_passes_them_for_bf16_training_shapes(monkeypatch, dtype, anchors, expect):
    """Prevents the tiles reaching fp32 inputs or fewer than 128 queries (torch's decoding kernel)."""
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=128, block_size=8, mask_token_id=127,
                        target_layer_ids=[0], num_target_layers=2)
    attn = DrafterAttention(cfg).to(dtype)
    attn.flex_options = dict(SM90_D128_FLEX_OPTIONS)
    seen = {}

    def fake_flex(q, k, v, block_mask, enable_gqa, kernel_options):
        seen["options"] = kernel_options
        return torch.zeros_like(q)

    monkeypatch.setattr(layers, "_flex_fn", lambda compiled: fake_flex)
    T, Q = 128, anchors * cfg.block_size
    lo = torch.zeros(1, anchors, dtype=torch.int32)
    hi = torch.arange(1, anchors + 1, dtype=torch.int32)[None] * 8
    if Q % 128:  # the mask builder needs whole 128-query tiles; the fake never reads the mask
        mask = build_block_mask(torch.zeros(1, 16, dtype=torch.int32), torch.arange(1, 17, dtype=torch.int32)[None],
                                T, cfg.block_size, None)
    else:
        mask = build_block_mask(lo, hi, T, cfg.block_size, None)
    h = torch.randn(1, Q, 64, dtype=dtype)
    ctx = torch.randn(1, T, 64, dtype=dtype)
    cos, sin = torch.ones(1, T + Q, 16), torch.zeros(1, T + Q, 16)
    attn(h, ctx, (cos[:, T:], sin[:, T:]), (cos, sin), mask, compile_flex=False)
    assert seen["options"] == (SM90_D128_FLEX_OPTIONS if expect else None)
