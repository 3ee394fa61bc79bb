"""Load a drafter for evaluation: one entry point, `load_drafter_checkpoint(path)`.

Accepted paths:
  * a checkpoint folder of this trainer (`config.json` with the DrafterConfig fields and a
    `dflash` metadata block, `model.safetensors`), e.g. runs/default/checkpoint-final;
  * a run folder holding `checkpoint-final/` (that checkpoint is used);
  * a serving-format folder (z-lab / SGLang `DFlashDraftModel`, or vLLM speculators
    `speculators_model_type: dflash`): detected from its config.json and read by
    `dflash_trainer.interop.load_drafter`.
The metadata carries what serving must match: chat template, thinking flag, and whether the
drafter was trained without target features (control drafter).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.evaluation.settings import checkpoint_format, resolve_drafter_path
from dflash_trainer.drafter.shape import check_fits_target
from dflash_trainer.target_model.load import TargetBundle
from dflash_trainer.interop.checkpoint_files import load_checkpoint


@dataclass
class DrafterCheckpoint:
    """A drafter ready to be built over a target. format: "checkpoint" (this trainer) | "zlab" |
    "speculators"."""

    config: DrafterConfig
    weights: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    path: Path
    format: str

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("chat_template")

    @property
    def enable_thinking(self) -> bool | None:
        return self.metadata.get("enable_thinking")

    @property
    def no_target_features(self) -> bool:
        return bool(self.metadata.get("no_target_features", False))


def load_drafter_checkpoint(path: str | Path, *, num_target_layers: int | None = None) -> DrafterCheckpoint:
    """Read a drafter (config, weights, metadata) from any supported folder (see module docstring).

    num_target_layers: the target's decoder-layer count; serving-format folders that do not record
    it need it, and when given it must match. Raises ValueError naming the path when the folder
    is not a drafter or cannot be loaded faithfully.
    """
    p = resolve_drafter_path(path)
    fmt = checkpoint_format(p)
    if fmt == "checkpoint":
        config, weights, metadata = load_checkpoint(p)
    else:
        # Serving formats: the interop importer owns their key maps and refuses what the
        # drafter cannot reproduce exactly.
        from dflash_trainer.interop.load_drafter import load_drafter

        config, weights, metadata = load_drafter(p, num_target_layers=num_target_layers)
    return DrafterCheckpoint(config=config, weights=weights, metadata=dict(metadata), path=p, format=fmt)


def build_drafter(ckpt: DrafterCheckpoint, target: TargetBundle) -> DFlashDrafter:
    """The drafter over the target's embedding and LM head, weights loaded, eval mode, on the
    target's device and in the target's dtype. Raises ValueError when the widths do not match."""
    c = ckpt.config
    check_fits_target(c, target, f"--drafter {ckpt.path}", "pass the target it was trained for (--target)")
    w = target.embed_tokens.weight
    drafter = DFlashDrafter(c, target.embed_tokens, target.lm_head, compile_flex=False)
    drafter.load_trainable_state_dict(ckpt.weights)
    return drafter.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
