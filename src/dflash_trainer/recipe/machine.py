"""This machine's free GPU memory for the plan, read in a short child process (when no --gpu-memory-gib is
given), so that the recipe's own process never holds a CUDA context while its stages use the card; and the
processes the mixture's math generator gets on it."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

_PROBE = ("import torch\n"
          "print(torch.cuda.mem_get_info(0)[0] if torch.cuda.is_available() else -1)\n")


def free_gpu_gib(device: Optional[str] = None) -> Optional[float]:
    """Free memory of GPU 0 in GiB, or None without CUDA (or with device 'cpu'). Raises RuntimeError when
    the probe (a child `python -c`, ~3 s) fails."""
    if device == "cpu":
        return None
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"reading the GPU's free memory failed: {r.stderr.strip()[-500:]}; "
                           "pass --gpu-memory-gib G to plan without it")
    free = int(r.stdout.strip().splitlines()[-1])
    return None if free < 0 else free / 1024**3


def mixture_workers() -> int:
    """Processes for the mixture stage's math generator and code parsing (`mixture --workers`): the CPUs
    this process may run on (its affinity, which containers narrow), at most the spec's cap on math workers
    (data/mixture/spec.py MAX_WORKERS). The records do not depend on it (data/mixture/maths.py, code_prompts.py)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    from dflash_trainer.data.mixture.spec import MAX_WORKERS

    return max(1, min(MAX_WORKERS, cpus))
