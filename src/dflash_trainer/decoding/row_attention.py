"""Step attention over each cache row's own key slots (`row_attention`), instead of a span shared by
every row (static_layer.py `cache_attention`).

A decode step of the continuous batch (decoding/continuous.py) attends, for every row, the cache slots
start[r] … end[r] − 1 (its sliding window, or 0 … its position); a verify step (step_attention "row",
decoding/batched.py) a block of n tokens a row, causal within it. `cache_attention` reads a span common to
all rows (the longest row's), so one long conversation makes every row read its slots: on the 2026-12-02
regeneration 3.1× the slots the rows needed (span efficiency 0.32, benchmarks/reports/2026-12-02-onpolicy-
full-6000.md). Here one Triton program per (row, KV head) reads its own slots in blocks of 64 (tensor-core
dots; 32 with fp32 dots), with an online softmax (as flash attention; Dao et al. 2022, §3.1) in fp32.
Callers pass every row (the `rows` of a layer step are 0 … R−1: BatchedTarget.step).

Shapes: m rows, Hkv KV heads, M = G·n query rows per KV head (a decode step: n = 1, M = G), S cache slots,
D head_dim (a power of two ≥ 16 for the kernel; other head dims take the torch path). Numerics: scores
accumulated in fp32 and kept in fp32 (`cache_attention` rounds them to the keys' dtype first); in bf16 the
probabilities are rounded to bf16 for p·v (`cache_attention` does the same), so the two paths differ by
rounding and a greedy near-tie can flip; in fp32 they agree to ~1e-6.
"""

from __future__ import annotations

import contextlib

import torch

from dflash_trainer.drafter.ce_rows import triton_usable

BLOCK_N = 32  # key slots per loop iteration of the kernel, fp32 (IEEE) dots
BLOCK_N_TENSOR_CORES = 64  # the same with bf16 / fp16 tensor-core dots


def kernel_tiles(head_dim: int) -> bool:
    """Whether the kernel can tile this head_dim: a power of two ≥ 16 (`tl.dot`'s smallest tile)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def row_kernel_runs(head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the regeneration defaults to `row_attention` for a target of this head_dim and dtype on
    `device`: CUDA with Triton importable, bf16 / fp16 (the tensor-core kernel; its fp32 IEEE-dot path was
    0.78× the shared span, docs/data.md) and a head_dim of 16 … 128, a power of two (the GPU tests' range;
    256 would tile 64 × 256 keys and values per block, not checked). Elsewhere the shared span is faster or
    the kernel unchecked (the torch path reads every cache slot of every row)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim > 128 \
            or not kernel_tiles(head_dim):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                  end: torch.Tensor, scale: float, *, backend: str | None = None,
                  tokens: int = 1, exact_dots: bool = False, block_n: int | None = None) -> torch.Tensor:
    """Attention of each row's queries over its own key slots start[r] … end[r] − 1.

    q [m,Hkv,M,D]; keys / values [m,Hkv,S,D] (any strides with a unit last dimension: cache views are read
    in place); start / end [m] long, 0 ≤ start < end ≤ S and end ≥ tokens (every query row sees at least one
    key; a block's first token at position end − tokens ≥ 0). tokens: the
    query tokens of a row, n (a verify step's block; M = G·n, query row g·n + i is token i's, as
    decoding/static_layer.py lays them out): start / end are the last token's slots, and token i sees
    the same slots shifted back by its distance d = n − 1 − i, max(0, start − d) … end − d − 1 (causal
    within the block; a sliding window moves with it). Returns
    [m,Hkv,M,D] in the values' dtype. backend: "triton" (the kernel), "torch" (`cache_attention`'s arithmetic
    over all S slots with the mask of the same slots: the reference, and the CPU path) or None (Triton when
    drafter/ce_rows.py `triton_usable`, the CE kernels' rule, and the head_dim is a power of two ≥ 16).
    The kernel takes bf16 / fp16 inputs on CUDA through tensor cores (fp32 accumulation, p rounded to the
    values' dtype before p·v, as flash attention); exact_dots=True, fp32 inputs and Triton's interpreter
    take fp32 IEEE dots. block_n: key slots per loop iteration (a power of two ≥ 16; default BLOCK_N_TENSOR_CORES
    or BLOCK_N), for benchmarks.
    Raises ValueError for mismatched shapes, start / end that are not contiguous integer tensors, a
    head_dim the kernel cannot tile (backend "triton") or an unknown backend.
    """
    m, H, M, D = q.shape
    if keys.shape[:2] != (m, H) or values.shape != keys.shape or keys.shape[-1] != D or start.shape != (m,) \
            or end.shape != (m,) or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}, start "
                         f"{tuple(start.shape)}, end {tuple(end.shape)}: need q [m,H,M,D], keys / values [m,H,S,D] "
                         "with a unit last stride, start / end [m]")
    if start.dtype not in (torch.int32, torch.int64) or end.dtype != start.dtype or start.stride() != (1,) \
            or end.stride() != (1,):
        raise ValueError(f"start {start.dtype} {start.stride()}, end {end.dtype} {end.stride()}: need contiguous int32 "
                         "or int64 [m]")
    if tokens < 1 or M % tokens:
        raise ValueError(f"tokens={tokens}: need >= 1 and dividing the {M} query rows")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n={block_n}: need a power of two >= 16")
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend={backend!r}: use 'triton', 'torch' or None")
    tileable = kernel_tiles(D)
    backend = backend or ("triton" if triton_usable(values) and tileable else "torch")
    if backend == "torch":  # the arithmetic of static_layer.cache_attention, over all S slots, masked
        slot = torch.arange(keys.shape[2], device=keys.device)
        back = (tokens - 1 - torch.arange(M, device=keys.device) % tokens)  # [M] query row's distance d
        lo = (start[:, None] - back[None]).clamp(min=0)  # [m,M]
        visible = (slot[None, None] >= lo[:, :, None]) & (slot[None, None] < (end[:, None] - back[None])[:, :, None])
        mask = torch.where(visible, 0.0, float("-inf"))[:, None].to(torch.float32)  # [m,1,M,S]
        scores = torch.matmul(q.to(keys.dtype), keys.transpose(-1, -2))  # [m,H,M,S]
        probs = torch.softmax(torch.add(mask, scores, alpha=scale), dim=-1)  # fp32
        return torch.matmul(probs.to(values.dtype), values)
    if not tileable:
        raise ValueError(f"head_dim {D}: the row attention kernel needs a power of two >= 16; use backend='torch'")
    from dflash_trainer.decoding.row_attention_kernel import row_attention_kernel

    q = q.contiguous() if q.stride(-1) != 1 else q
    out = torch.empty(q.shape, dtype=values.dtype, device=values.device)
    block_g = max(16, 1 << (M - 1).bit_length())
    tensor_cores = (not exact_dots and values.dtype in (torch.bfloat16, torch.float16) and values.is_cuda
                    and q.dtype == values.dtype == keys.dtype)
    block_n = block_n or (BLOCK_N_TENSOR_CORES if tensor_cores else BLOCK_N)
    with torch.cuda.device(values.device) if values.is_cuda else contextlib.nullcontext():
        row_attention_kernel[(m, H)](q, keys, values, out, start, end, *q.stride()[:3], *keys.stride()[:3],
                                     *values.stride()[:3], *out.stride()[:3], M, tokens, float(scale), D=D, BLOCK_G=block_g,
                                     BLOCK_N=block_n, TENSOR_CORES=tensor_cores)
    return out
