"""A CPU stand-in for counting the CUDA kernels a step launches (what a CUDA graph replays).

`KernelCount` counts the aten ops that compute (views, allocations and host reads are free), as
dispatched on the CPU. Fused ops that the CPU build decomposes but CUDA runs as one kernel
(`F.rms_norm`) count once. Use:

    with KernelCount() as k:
        engine.plain_step(engine.max_len)
    k.total, k.ops  # Counter by op name
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FREE = {"empty", "empty_strided", "_local_scalar_dense", "lift_fresh", "detach", "alias", "_unsafe_view"}
FUSED_ON_CUDA = {F.rms_norm, torch.rms_norm}


class _Ops(TorchDispatchMode):
    def __init__(self, owner: "KernelCount"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.owner.inside_fused and not func.is_view and name not in FREE:
            self.owner.ops[name] += 1
        return out


class _Fused(TorchFunctionMode):
    def __init__(self, owner: "KernelCount"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in FUSED_ON_CUDA:
            return func(*args, **(kwargs or {}))
        self.owner.inside_fused += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.owner.inside_fused -= 1
            self.owner.ops[func.__name__] += 1


class KernelCount:
    """Context manager: `ops` (Counter of op name → launches) and `total` of the code run inside."""

    def __init__(self):
        self.ops: Counter[str] = Counter()
        self.inside_fused = 0
        self._modes = (_Ops(self), _Fused(self))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __enter__(self) -> "KernelCount":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
