"""One drafter step: anchors → blocks → masks → drafter → loss sums (no host syncs).

Shapes: R rows, T packed tokens, N anchors, B block size, Q = N·B, H hidden, k target layers.
The step is the same code path for training, benchmarks and tests; only the mask realization
differs by device (flex BlockMask on CUDA, dense boolean + SDPA elsewhere; flex has no CPU
backward from torch 2.11). Its parts are marked as profiler sections (blocks, mask_build,
drafter_forward, lm_head_loss; telemetry/sections.py): ranges only while a profiler records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dflash_trainer.config.schema import field_default
from dflash_trainer.drafter.anchors import sample_anchors
from dflash_trainer.drafter.blocks import Blocks, build_blocks
from dflash_trainer.drafter.feature_dropout import DropoutUnit, drop_features, feature_keep_mask
from dflash_trainer.drafter.loss import LossImpl, LossSums, block_loss
from dflash_trainer.drafter.masks import build_block_masks, build_dense_masks
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.rejection import block_correct, rejection_scale
from dflash_trainer.drafter.weights import LossKind, PositionWeights, needs_target_hidden
from dflash_trainer.telemetry.sections import section

MaskKind = Literal["flex", "dense"]


@dataclass
class StepSettings:
    """Objective settings of a step (a slice of TrainConfig, resolved; `run.step_settings` builds it
    from a config). The objective fields default to TrainConfig's defaults; the device-dependent
    ones (mask_kind, compiled_loss) to the CPU path."""

    num_anchors: int
    gamma: float  # position decay γ of the decay weights
    label_source: Literal["target", "data"] = field_default("label_source")
    loss: LossKind = field_default("loss.kind")  # per-slot loss: ce | kl | ce_kl (loss_ce_weight·CE + loss_kl_weight·KL)
    per_document_quota: bool = field_default("per_document_quota")
    mask_kind: MaskKind = "dense"
    loss_chunk: int | None = field_default("loss_chunk")  # LM-head positions per chunk (None = all at once)
    compiled_loss: bool = False  # torch.compile the LM-head + CE chunk (CUDA)
    loss_impl: LossImpl = field_default("loss_impl")  # LM-head + loss gradient: autograd | fused (drafter/fused_loss.py)
    zero_features: bool = field_default("no_target_features")  # zeros for the target features (control drafter)
    position_weights: PositionWeights = field_default("position_weights")  # per-slot weights: decay (γ) | dpace | cat
    dpace_alpha: float = field_default("dpace_alpha")  # D-PACE confidence smoothing α
    dpace_denominator: Literal["blocks", "weights"] = field_default("dpace_denominator")  # ÷ valid blocks or ÷ Σ w
    loss_ce_weight: float = field_default("loss_ce_weight")  # CE coefficient of loss ce_kl (PARD-2 recipe: 0.1)
    loss_kl_weight: float = field_default("loss_kl_weight")  # KL coefficient of loss ce_kl (PARD-2 recipe: 1.0)
    feature_dropout: float = field_default("feature_dropout")  # training only: drop probability of target features
    feature_dropout_unit: DropoutUnit = field_default("feature_dropout_unit")  # dropped whole: document | position
    rejection_weight: float = field_default("rejection_weight")  # training only: λ of drafter/rejection.py (0 = off)


def default_mask_kind(device: torch.device) -> MaskKind:
    """flex on CUDA; dense SDPA masks elsewhere (no flex backward on CPU)."""
    return "flex" if device.type == "cuda" else "dense"


def make_blocks(rows: dict[str, torch.Tensor], target_argmax: torch.Tensor | None, drafter: DFlashDrafter,
                settings: StepSettings, generator: "torch.Generator | list[torch.Generator] | None") -> Blocks:
    """Sample anchors on the device and lay out the blocks (inputs, positions, labels, weights).

    rows: input_ids/position_ids [R,T] int64, loss_mask [R,T] bool. target_argmax [R,T] int64
    (needed when label_source == "target").
    """
    cfg = drafter.config
    anchors, valid = sample_anchors(rows["loss_mask"], rows["position_ids"], settings.num_anchors, generator,
                                    per_document_quota=settings.per_document_quota)
    return build_blocks(rows["input_ids"], rows["loss_mask"], rows["position_ids"], anchors, valid,
                        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, gamma=settings.gamma,
                        label_source=settings.label_source, target_argmax=target_argmax)


def make_masks(blocks: Blocks, seq_len: int, drafter: DFlashDrafter, kind: MaskKind) -> dict:
    """Build one mask per distinct attention window of the drafter's layers, in one pass."""
    windows = drafter.config.attention_windows()
    builder = build_block_masks if kind == "flex" else build_dense_masks
    return builder(blocks.context_lo, blocks.context_hi, seq_len, drafter.config.block_size, windows)


def slot_target_hidden(last_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Target's final hidden state that predicts slot k of block j: position anchor_j + k − 1.

    last_hidden [R,T,H], anchors [R,N] int64 → [R,N·B,H] (slot 0 reads position anchor−1, clamped;
    it is never trained). Gather with fixed shapes, no host sync.
    """
    R, T, H = last_hidden.shape
    k = torch.arange(block_size, device=anchors.device)
    pos = (anchors[:, :, None] + k - 1).clamp(0, T - 1).reshape(R, -1)  # [R,Q]
    return torch.gather(last_hidden, 1, pos[..., None].expand(R, pos.shape[1], H))


def drafter_step(drafter: DFlashDrafter, rows: dict[str, torch.Tensor], features: torch.Tensor,
                 target_argmax: torch.Tensor | None, settings: StepSettings,
                 generator: "torch.Generator | list[torch.Generator] | None",
                 target_last_hidden: torch.Tensor | None = None, *, train: bool = False) -> LossSums:
    """Forward pass of one step; returns on-device loss/metric sums (caller divides and backprops).

    features: [R,T,k·H] target aux hidden states; target_last_hidden [R,T,H] final-normed target
    states, required when the objective reads the target's distribution (loss kl / ce_kl or
    position_weights cat; ValueError otherwise). train: a training step — only then is
    settings.feature_dropout applied (drawn from `generator` after the anchors), and
    settings.rejection_weight (drafter/rejection.py: one more LM-head forward); validation and
    evaluation leave it False. Shape errors come from the mask builder (T and Q multiples of 128
    on the flex path).
    """
    if needs_target_hidden(settings.loss, settings.position_weights) and target_last_hidden is None:
        raise ValueError(f"loss.kind={settings.loss} with position_weights={settings.position_weights} needs the "
                         "target's final hidden states (target_last_hidden)")
    with section("blocks"):
        if settings.zero_features:
            features = torch.zeros_like(features)
        blocks = make_blocks(rows, target_argmax, drafter, settings, generator)
        if train and settings.feature_dropout > 0 and not settings.zero_features:
            keep = feature_keep_mask(rows["position_ids"], settings.feature_dropout, settings.feature_dropout_unit,
                                     generator)  # [R,T], after the anchors: they stay as without dropout
            features = drop_features(features, keep)
    with section("mask_build"):
        masks = make_masks(blocks, rows["input_ids"].shape[1], drafter, settings.mask_kind)
    with section("drafter_forward"):
        hidden = drafter(features, rows["position_ids"], blocks.block_input_ids, blocks.block_position_ids, masks)
    with section("lm_head_loss"):
        target_hidden = None
        if needs_target_hidden(settings.loss, settings.position_weights):
            target_hidden = slot_target_hidden(target_last_hidden, blocks.anchors, drafter.config.block_size)
        scale = None
        if train and settings.rejection_weight > 0:
            B = drafter.config.block_size
            correct = block_correct(hidden, drafter.lm_head_weight, blocks.labels, blocks.slot_valid, B,
                                    settings.loss_chunk)
            valid = blocks.slot_valid.reshape(-1, B)[:, 1:]
            scale = rejection_scale(correct, valid, blocks.anchors, blocks.anchor_valid, rows["input_ids"].shape[1],
                                    settings.rejection_weight)
        return block_loss(hidden, drafter.lm_head_weight, blocks.labels, blocks.loss_weight,
                          block_size=drafter.config.block_size, kind=settings.loss, target_hidden=target_hidden,
                          slot_valid=blocks.slot_valid, chunk_size=settings.loss_chunk,
                          compiled=settings.compiled_loss, position_weights=settings.position_weights,
                          dpace_alpha=settings.dpace_alpha, dpace_denominator=settings.dpace_denominator,
                          ce_weight=settings.loss_ce_weight, kl_weight=settings.loss_kl_weight,
                          logit_scale=drafter.config.logit_scale, logit_softcap=drafter.config.logit_softcap,
                          loss_impl=settings.loss_impl, block_scale=scale)
