"""The drafter a run trains, built the same way in every layout (and in the split probe)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.fp8 import check_fp8, convert_fp8, fp8_linears


def frozen_modules(embed_w: torch.Tensor, head_w: torch.Tensor, device: torch.device) -> tuple[nn.Embedding, nn.Linear]:
    """nn.Embedding / nn.Linear around the target's weights [V,H] (frozen; tied weights stay one tensor)."""
    tied = embed_w.data_ptr() == head_w.data_ptr()
    emb = nn.Embedding.from_pretrained(embed_w.to(device), freeze=True)
    head = nn.Linear(embed_w.shape[1], embed_w.shape[0], bias=False, device="meta")
    head.weight = emb.weight if tied else nn.Parameter(head_w.to(device), requires_grad=False)
    return emb, head


def build_drafter(cfg: TrainConfig, dc: DrafterConfig, head: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                  init: dict[str, torch.Tensor] | None = None, log: Callable[[str], None] | None = None) -> DFlashDrafter:
    """The drafter a drafter rank trains (the split probe times the same one): seeded by cfg.seed (the
    same initial weights on every rank), built on `device`, around the target's frozen embedding and
    LM head `head` = (embed [V,H], lm_head [V,H]), warm-started from `init` weights, its linears
    converted to FP8 matmuls when cfg.experimental.fp8 is not off (drafter/fp8.py; `log` gets the line saying
    which), then layers compiled on CUDA when cfg.runtime.compile. Raises ValueError when cfg.experimental.fp8 cannot run
    on `device` (training.fp8.check_fp8)."""
    fp8 = cfg.experimental.fp8
    check_fp8(fp8, device)  # before the weights are made: a refused setting costs nothing
    emb, lm_head = frozen_modules(*head, device)
    torch.manual_seed(cfg.runtime.seed)
    with torch.device(device):  # initialized where it trains (1B random values take seconds on a CPU)
        drafter = DFlashDrafter(dc, emb, lm_head, checkpoint_layers=cfg.experimental.checkpoint_policy(), compile_flex=cfg.runtime.compile)
    if init is not None:
        drafter.load_trainable_state_dict(init)
    prepare_for_training(drafter, fp8, compile_layers=device.type == "cuda" and cfg.runtime.compile, log=log)
    return drafter


def prepare_for_training(drafter: DFlashDrafter, fp8: str, *, compile_layers: bool,
                         log: Callable[[str], None] | None = None) -> None:
    """FP8 conversion (`fp8` not off), then compilation, in that order: the compiled layers then hold
    the FP8 linears and fuse their casts. With FP8, `fc` (outside the layers) is compiled too, so its
    input's cast and scales are fused kernels rather than eager ones. The device checks are the
    caller's (`check_fp8`)."""
    if fp8 != "off":
        plan = convert_fp8(drafter, fp8)
        if log is not None:
            log(plan.line(fp8))
    if compile_layers:
        drafter.compile_layers()
        if fp8 != "off" and "fc" in fp8_linears(drafter):
            drafter.fc.compile(dynamic=False)
