"""The drafter a run trains, built the same way in every layout (and in the split probe)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter


def frozen_modules(embed_w: torch.Tensor, head_w: torch.Tensor, device: torch.device) -> tuple[nn.Embedding, nn.Linear]:
    """nn.Embedding / nn.Linear around the target's weights [V,H] (frozen; tied weights stay one tensor)."""
    tied = embed_w.data_ptr() == head_w.data_ptr()
    emb = nn.Embedding.from_pretrained(embed_w.to(device), freeze=True)
    head = nn.Linear(embed_w.shape[1], embed_w.shape[0], bias=False, device="meta")
    head.weight = emb.weight if tied else nn.Parameter(head_w.to(device), requires_grad=False)
    return emb, head


def build_drafter(cfg: Any, dc: DrafterConfig, head: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                  init: dict[str, torch.Tensor] | None = None) -> DFlashDrafter:
    """The drafter a drafter rank trains (the split probe times the same one): seeded by cfg.seed (the
    same initial weights on every rank), built on `device`, around the target's frozen embedding and
    LM head `head` = (embed [V,H], lm_head [V,H]), warm-started from `init` weights, layers compiled
    on CUDA when cfg.compile."""
    emb, lm_head = frozen_modules(*head, device)
    torch.manual_seed(cfg.seed)
    with torch.device(device):  # initialized where it trains (1B random values take seconds on a CPU)
        drafter = DFlashDrafter(dc, emb, lm_head, checkpoint_layers=cfg.checkpoint_policy(), compile_flex=cfg.compile)
    if init is not None:
        drafter.load_trainable_state_dict(init)
    if device.type == "cuda" and cfg.compile:
        drafter.compile_layers()
    return drafter
