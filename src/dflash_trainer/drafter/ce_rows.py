"""Cross-entropy over LM-head rows in two memory-speed passes: row statistics, then the gradient in place.

Shapes: N rows (trained block slots), V vocabulary. z_raw [N,V] is the LM head's output h Wᵀ (bf16 under
the step's autocast), labels [N] int64 in [0, V). The target's logits function is applied on the fly:
z = s·z_raw, then c·tanh(z/c) (target_model/shared_head.py `transform_logits`; s = logit_scale, c = logit_softcap).

  row_stats        one read of z_raw: lse = log Σ_v exp(z_v) (online max and sum), z_y = z at the
                   label, argmax (first index of the maximum, as torch.argmax)          all fp32 / int64 [N]
  ce_logit_grad_   one read and one write of z_raw: z_raw := coef · (softmax(z) − onehot(y)) · ∂z/∂z_raw,
                   the gradient of Σ coef·CE with respect to z_raw, in z_raw's dtype

That is everything the CE loss, its D-PACE / CAT weights, the accuracy and the gradient need, without
any [N,V] fp32 tensor: 3 × N·V·2 bytes of traffic in bf16. On CUDA both are Triton kernels (one program
per row, the vocabulary in tiles of `_TILE`); elsewhere (CPU, fp64 tests) the same math in torch ops.
The kernels run under Triton's interpreter too (TRITON_INTERPRET=1 set before Triton is first imported),
which is how the CPU tests check them.
Method: the online softmax of Milakov & Gimelshein (arXiv 1805.02867) for the log-sum-exp; the gradient
softmax − onehot is the closed form of drafter/fused_loss.py.
"""

from __future__ import annotations

import contextlib
import os

import torch

from dflash_trainer.target_model.shared_head import transform_logits
from dflash_trainer.drafter.weights import logits_dtype

# Vocabulary columns per tile and warps per program, from benchmarks/ce_rows_options.py on an H200 at the
# reference shape (results/ce-rows-options_h200_2026-12-03.json): statistics 0.96 ms with 4 warps (0.99 with 8),
# gradient 1.20 ms with 8 warps; tiles of 2,048–8,192 columns within 10 % of each other.
_TILE = 4096
_STATS_WARPS = 4
_GRAD_WARPS = 8


def triton_usable(z: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on `z`: a CUDA tensor (or any tensor under TRITON_INTERPRET=1)
    in bf16 / fp16 / fp32 with Triton importable."""
    if z.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if not (z.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels():
    """drafter/ce_kernels.py, imported at first use (it imports Triton)."""
    from dflash_trainer.drafter import ce_kernels

    return ce_kernels


def _launch_args(z_raw: torch.Tensor, scale: float, softcap: float | None, warps: int) -> tuple[tuple, dict]:
    v = z_raw.shape[1]
    tile = min(_TILE, 1 << max(4, (v - 1).bit_length()))
    return (v, float(scale), float(softcap or 1.0)), dict(HAS_SCALE=scale != 1.0, HAS_SOFTCAP=softcap is not None,
                                                         TILE=tile, num_warps=warps)


def _on(z: torch.Tensor):
    """Launch on z's GPU (Triton launches on the current device), or nothing to switch (CPU, interpreter)."""
    return torch.cuda.device(z.device) if z.is_cuda else contextlib.nullcontext()


def _backend(z_raw: torch.Tensor, labels: torch.Tensor, backend: str | None) -> str:
    """The backend to run on (None: Triton when `triton_usable`), after checking the arguments."""
    if z_raw.dim() != 2 or z_raw.stride(1) != 1 or labels.shape != z_raw.shape[:1]:
        raise ValueError(f"z_raw {tuple(z_raw.shape)} (strides {z_raw.stride()}) / labels {tuple(labels.shape)}: "
                         "need z_raw [N,V] with contiguous rows and labels [N]")
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend={backend!r}: use 'triton', 'torch' or None")
    return backend or ("triton" if triton_usable(z_raw) else "torch")


def row_stats(z_raw: torch.Tensor, labels: torch.Tensor, scale: float = 1.0, softcap: float | None = None, *,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the transformed logits z = t(z_raw): (lse, z_y, argmax).

    z_raw [N,V] float (rows contiguous), labels [N] int64 in [0, V) (callers put 0 on invalid rows).
    Returns lse [N] = logsumexp(z), z_y [N] = z[label], both in `logits_dtype(z_raw)` (fp32; fp64 for
    fp64 input), and argmax [N] int64 (first maximal index; a row with NaN logits gets NaN statistics,
    its argmax then differs from torch's, and the step is skipped as not finite). backend: "triton",
    "torch" or None (Triton when `triton_usable`). Raises ValueError for other shapes or an unknown
    backend. No host sync."""
    if _backend(z_raw, labels, backend) == "torch":
        z = transform_logits(z_raw.to(logits_dtype(z_raw)), scale, softcap)
        return torch.logsumexp(z, -1), z.gather(-1, labels[:, None]).squeeze(-1), z.argmax(-1)
    n = z_raw.shape[0]
    lse = torch.empty(n, device=z_raw.device, dtype=torch.float32)
    zy = torch.empty_like(lse)
    amax = torch.empty(n, device=z_raw.device, dtype=torch.int64)
    if n:
        args, meta = _launch_args(z_raw, scale, softcap, _STATS_WARPS)
        with _on(z_raw):
            _kernels().row_stats_kernel[(n,)](z_raw, z_raw.stride(0), labels.contiguous(), lse, zy, amax, *args, **meta)
    return lse, zy, amax


def ce_logit_grad_(z_raw: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                   scale: float = 1.0, softcap: float | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Overwrite z_raw [N,V] with ∂(Σ_rows coef·CE)/∂z_raw = coef·(softmax(z) − onehot(label))·∂z/∂z_raw.

    labels [N] int64 in [0, V); lse [N] from `row_stats` (same z_raw, scale, softcap); coef [N] fp32
    (0 on rows that carry no loss: their gradient row is written as zeros). Returns z_raw (same storage,
    same dtype). backend and errors as in `row_stats`. No host sync."""
    if _backend(z_raw, labels, backend) == "torch":
        acc = logits_dtype(z_raw)
        c = coef.to(acc)[:, None]
        if z_raw.dtype == acc and softcap is None:  # in place: no [N,V] temporary (the CPU training path)
            z = z_raw.mul_(scale) if scale != 1.0 else z_raw
            grad = z.sub_(lse.to(acc)[:, None]).exp_().mul_(c * scale)
            return grad.scatter_add_(1, labels[:, None], -c * scale)
        z = transform_logits(z_raw.to(acc), scale, softcap)
        grad = torch.exp(z - lse.to(acc)[:, None]) * c
        grad.scatter_add_(1, labels[:, None], -c)
        if softcap is not None:
            grad = grad * (scale * (1.0 - (z / softcap) ** 2))
        elif scale != 1.0:
            grad = grad * scale
        return z_raw.copy_(grad)
    if z_raw.shape[0]:
        args, meta = _launch_args(z_raw, scale, softcap, _GRAD_WARPS)
        with _on(z_raw):
            _kernels().logit_grad_kernel[(z_raw.shape[0],)](z_raw, z_raw.stride(0), labels.contiguous(),
                                                            lse.float().contiguous(), coef.float().contiguous(),
                                                            *args, **meta)
    return z_raw
