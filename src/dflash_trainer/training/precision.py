"""Numeric precision by device: the one rule for the target's dtype and the drafter's autocast.

On CUDA the frozen target runs in bf16 (its weights and the features it produces) and the drafter
trains under bf16 autocast with fp32 master weights; elsewhere everything is fp32 and autocast is
off. Training, validation, the split probe, the pipeline's ranks, regenerate and the benchmarks
all ask here.
"""

from __future__ import annotations

import torch


def compute_dtype(device: torch.device) -> torch.dtype:
    """Dtype of the target's weights and of the features on `device`: bf16 on CUDA, fp32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def autocast(device: torch.device) -> torch.autocast:
    """The drafter's autocast context on `device`: bf16 on CUDA, disabled elsewhere (plain fp32).
    Reusable: enter it once per step."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
