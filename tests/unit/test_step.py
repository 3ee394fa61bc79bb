"""The step's glue: target states for KL slots, and a full CPU step with both objectives."""

import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.training.step import StepSettings, drafter_step, slot_target_hidden


def test_slot_target_hidden_reads_anchor_plus_k_minus_one():
    """Prevents an EAGLE-style shift in KL distillation: slot k is matched to the target's state at a+k−1."""
    T, H = 10, 2
    last = torch.arange(T, dtype=torch.float32)[None, :, None].expand(1, T, H)  # value = position
    got = slot_target_hidden(last, torch.tensor([[3, 8]]), block_size=4)[0, :, 0]
    # anchor 3: positions 2,3,4,5; anchor 8: 7,8,9, then 10 clamped to 9 (never valid, weight 0)
    assert got.tolist() == [2, 3, 4, 5, 7, 8, 9, 9]


def test_cpu_step_ce_and_kl_are_finite_and_differentiable():
    """Prevents the KL option being accepted but not wired: both objectives give finite, different losses with gradients."""
    torch.manual_seed(0)
    V, H, T = 64, 32, 24
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=V, block_size=4, mask_token_id=V - 1,
                        target_layer_ids=[0, 1], num_target_layers=2, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=5)
    emb, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    drafter = DFlashDrafter(cfg, emb, head)
    pos = torch.cat([torch.arange(12), torch.arange(12)])[None]
    rows = {"input_ids": torch.randint(0, V - 1, (1, T)), "position_ids": pos, "loss_mask": pos >= 3}
    feats = torch.randn(1, T, 2 * H)
    argmax = torch.randint(0, V - 1, (1, T))
    last_hidden = torch.randn(1, T, H)
    losses = {}
    for kind in ("ce", "kl"):
        s = StepSettings(num_anchors=6, gamma=2.0, loss=kind)
        sums = drafter_step(drafter, rows, feats, argmax, s, torch.Generator().manual_seed(3), last_hidden)
        loss = sums.loss_sum / sums.weight_sum
        loss.backward()
        assert torch.isfinite(loss) and sums.weight_sum > 0
        assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
        drafter.zero_grad()
        losses[kind] = float(loss.detach())
    assert losses["ce"] != losses["kl"]
