"""This machine's free GPU memory for the plan (torch imported only here, when no --gpu-memory-gib is given)."""

from __future__ import annotations

from typing import Optional


def free_gpu_gib(device: Optional[str] = None) -> Optional[float]:
    """Free memory of GPU 0 in GiB, or None without CUDA (or with device 'cpu')."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(0)
    return free / 1024**3
