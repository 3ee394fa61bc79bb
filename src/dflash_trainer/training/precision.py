"""Numeric precision by device: the one rule for the target's dtype and the drafter's autocast.

On CUDA the frozen target runs in bf16 (its weights and the features it produces) and the drafter
trains under bf16 autocast with fp32 master weights; elsewhere everything is fp32 and autocast is
off. Training, validation, the split probe, the pipeline's ranks, regenerate and the benchmarks
all ask here.
"""

from __future__ import annotations

import os

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


# A CPU whose 1-minute load average is at least this fraction of its cores is busy: torch's default of
# one intra-op thread per core then fights the other work, and one thread is often several times faster.
BUSY_LOAD_FRACTION = 0.75


def set_cpu_threads(threads: int | None, device: torch.device, one_thread: str) -> str | None:
    """Apply `threads` (torch's intra-op CPU threads; None = torch's default, one per core) and return
    a hint line, or None: on a CPU device with `threads` unset and a busy machine (1-minute load
    average ≥ BUSY_LOAD_FRACTION × cores), the line says so and names `one_thread` (the setting
    that runs one thread, e.g. "--threads 1"). Raises ValueError for threads < 1."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads={threads}: use a positive number of threads")
        torch.set_num_threads(threads)
        return None
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < BUSY_LOAD_FRACTION * cores:
        return None
    return (f"the CPU is busy (load {load:.1f} on {cores} cores) and torch uses {torch.get_num_threads()} threads: "
            f"{one_thread} is often several times faster on a shared CPU")
