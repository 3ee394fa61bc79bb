"""Wall and GPU times of repeated calls: CUDA events on a GPU, the host clock elsewhere (milliseconds)."""

from __future__ import annotations

import time

import torch


def cuda_times(fn, iters: int) -> list[float]:
    """GPU time in ms of each of `iters` calls of fn, measured with CUDA events."""
    out = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return out


def times_ms(fn, iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` calls of fn: CUDA events on a GPU, the host clock elsewhere."""
    if device.type == "cuda":
        return cuda_times(fn, iters)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out
