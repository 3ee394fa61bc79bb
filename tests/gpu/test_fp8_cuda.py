"""GPU-only: FP8 matmuls for the drafter (setting `fp8`, drafter/fp8.py) with torchao's real kernels.

A small Qwen3-like drafter (every linear's dims multiples of 16) is built as `train` builds it
(`build_drafter`: FP8 linears, then compiled layers) in bf16 and in FP8, from the same seed, and
trained on the same fixed target outputs with the real step (anchors, flex masks, compiled layers and
loss, bf16 autocast, clip, fused AdamW):

- the first-step loss of FP8 is within 2 % of bf16's (same weights and anchors), and after 8 steps
  on the batch both have fallen and are within 5 % of each other;
- every gradient is finite; the state_dict keys, shapes and dtypes (fp32 master weights) are those
  of the bf16 drafter;
- the checkpoint exports (zlab) and loads back into the plain bf16 drafter eval builds, whose
  forward agrees with the FP8 drafter's (relative error below 5 %: FP8 operands carry 3 mantissa bits;
  about 1 % at initialization in torchao's fp32 emulation on the CPU).

Skipped without CUDA, on a GPU below compute capability 8.9, or without torchao.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.bench.common import BenchShape, synthetic_rows
from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.drafter.masks import build_block_masks
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter import fp8
from dflash_trainer.drafter.build import build_drafter
from dflash_trainer.training.optim import build_optimizer
from dflash_trainer.training.step import StepSettings, drafter_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="FP8 matmuls need compute capability 8.9+"),
    pytest.mark.skipif(not fp8.torchao_installed(), reason="needs torchao (pip install '.[fp8]')"),
]

SHAPE = BenchShape(hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                   vocab_size=4096, num_target_layers=8, num_target_features=3, seq_len=1024, num_documents=4,
                   num_anchors=64, block_size=16, layer_types="last-full", sliding_window=256)
FIRST_STEP_REL_TOL = 0.02
AFTER_TRAINING_REL_TOL = 0.05
FORWARD_REL_TOL = 0.05


def _head(dev):
    g = torch.Generator(device=dev).manual_seed(7)
    dc = SHAPE.drafter_config()
    embed = torch.randn(dc.vocab_size, dc.hidden_size, device=dev, generator=g, dtype=torch.bfloat16)
    head = torch.randn(dc.vocab_size, dc.hidden_size, device=dev, generator=g, dtype=torch.bfloat16) * 0.05
    return embed, head


def _inputs(dev):
    dc = SHAPE.drafter_config()
    g = torch.Generator(device=dev).manual_seed(1)
    feats = torch.randn(1, SHAPE.seq_len, dc.num_aux_layers * dc.hidden_size, device=dev, generator=g,
                        dtype=torch.bfloat16)
    argmax = torch.randint(0, dc.vocab_size - 1, (1, SHAPE.seq_len), device=dev, generator=g)
    return synthetic_rows(SHAPE, dev), feats, argmax


def _build(setting: str, dev) -> DFlashDrafter:
    cfg = TrainConfig(fp8=setting, seed=0)
    lines: list[str] = []
    drafter = build_drafter(cfg, SHAPE.drafter_config(), _head(dev), dev, log=lines.append)
    assert bool(lines) == (setting != "off")
    return drafter


def _train(drafter: DFlashDrafter, steps: int, dev) -> tuple[list[float], dict[str, bool]]:
    """`steps` optimizer steps on one fixed batch (the same anchors each step); the losses, and per
    parameter whether every gradient of the first step was finite."""
    rows, feats, argmax = _inputs(dev)
    settings = StepSettings(num_anchors=SHAPE.num_anchors, gamma=7.0, mask_kind="flex", compiled_loss=True)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr=1e-3, weight_decay=0.0)
    names = {id(p): n for n, p in drafter.named_parameters()}
    losses, finite = [], {}
    for i in range(steps):
        gen = torch.Generator(device=dev).manual_seed(3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            sums = drafter_step(drafter, rows, feats, argmax, settings, gen, None, train=True)
        loss = sums.loss_sum / sums.weight_sum.clamp_min(1.0)
        loss.backward()
        if i == 0:
            finite = {names[id(p)]: bool(torch.isfinite(p.grad).all()) for p in params}
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, finite


@pytest.mark.parametrize("recipe", fp8.FP8_RECIPES)
def test_fp8_step_tracks_bf16_and_saves_plain_weights(recipe, tmp_path):
    dev = torch.device("cuda")
    ref = _build("off", dev)
    d8 = _build(recipe, dev)
    assert sorted(fp8.fp8_linears(d8)) == sorted(fp8.fp8_plan(ref).convert) and fp8.fp8_linears(ref) == []
    assert len(fp8.fp8_linears(d8)) == 1 + 7 * SHAPE.num_layers  # fc + q/k/v/o + gate/up/down per layer
    sd_ref, sd8 = ref.state_dict(), d8.state_dict()
    assert list(sd8) == list(sd_ref)
    assert all((sd8[k].dtype, sd8[k].shape) == (sd_ref[k].dtype, sd_ref[k].shape) for k in sd_ref)
    assert all(torch.equal(sd8[k], sd_ref[k]) for k in sd_ref)  # the same seed: the same initial weights

    l_ref, _ = _train(ref, 8, dev)
    l8, finite = _train(d8, 8, dev)
    assert all(finite.values()), [n for n, ok in finite.items() if not ok]
    assert abs(l8[0] - l_ref[0]) <= FIRST_STEP_REL_TOL * l_ref[0], (l8[0], l_ref[0])
    assert l8[-1] < l8[0] and l_ref[-1] < l_ref[0], (l8, l_ref)
    assert abs(l8[-1] - l_ref[-1]) <= AFTER_TRAINING_REL_TOL * l_ref[-1], (l8, l_ref)
    assert all(v.dtype == torch.float32 for v in d8.trainable_state_dict().values())

    # checkpoint → export → the plain drafter eval builds: same weights, a close forward
    from dflash_trainer.interop.export import write_export
    from dflash_trainer.interop.load_drafter import load_drafter
    from dflash_trainer.interop.checkpoint_files import save_checkpoint

    meta = {"target": "random", "chat_template": None, "mask_token_reason": "last row", "step": 8}
    ck = save_checkpoint(tmp_path / "checkpoint-8", d8.trainable_state_dict(), d8.config, meta)
    dc, weights, m = load_drafter(ck)
    write_export(tmp_path / "zlab", "zlab", dc, weights, m, dtype=torch.bfloat16)
    dc2, w2, _ = load_drafter(tmp_path / "zlab")
    back = DFlashDrafter(dc2, d8.embed_tokens, d8.lm_head, compile_flex=False).to(dev)
    back.load_trainable_state_dict({k: v.float() for k, v in w2.items()})
    for k, v in d8.trainable_state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v.to(torch.bfloat16).float(), rtol=0, atol=0)
    rows, feats, argmax = _inputs(dev)
    settings = StepSettings(num_anchors=SHAPE.num_anchors, gamma=7.0, mask_kind="flex")
    from dflash_trainer.training.step import make_blocks

    blocks = make_blocks(rows, argmax, back, settings, torch.Generator(device=dev).manual_seed(3))
    masks = build_block_masks(blocks.context_lo, blocks.context_hi, SHAPE.seq_len, dc.block_size,
                              dc.attention_windows())
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        args = (feats, rows["position_ids"], blocks.block_input_ids, blocks.block_position_ids, masks)
        h8, hb = d8(*args).float(), back(*args).float()
    rel = float((h8 - hb).norm() / hb.norm())
    assert rel < FORWARD_REL_TOL, rel
