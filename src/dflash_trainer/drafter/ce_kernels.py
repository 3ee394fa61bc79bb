"""The Triton kernels of drafter/ce_rows.py (their contracts are there): one program per row of an [N,V]
LM-head output, the vocabulary in tiles of TILE columns. Imported only where Triton is installed.

  row_stats_kernel    lse (online max and sum), the label's logit, argmax (first maximum)
  logit_grad_kernel   z_raw := coef · (softmax(z) − onehot(y)) · ∂z/∂z_raw, in place

z = s·z_raw, then c·tanh(z/c) when HAS_SCALE / HAS_SOFTCAP (the target's logits function), computed in
fp32 from the row's dtype.
"""

import triton
import triton.language as tl


@triton.jit
def _transform(z, scale, softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    if HAS_SCALE:
        z = z * scale
    if HAS_SOFTCAP:  # c·tanh(z/c), tanh(x) = 1 − 2 / (exp(2x) + 1): exact at ±∞
        z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
    return z


@triton.jit
def row_stats_kernel(z_ptr, stride, labels_ptr, lse_ptr, zy_ptr, amax_ptr, V, scale, softcap,
                     HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    y = tl.load(labels_ptr + row)
    m = -3.4028234663852886e38  # −FLT_MAX, finite: a tile of −inf logits gives exp(−inf) = 0, not NaN
    s = 0.0
    best_v = tl.full([TILE], float("-inf"), tl.float32)  # per lane: its largest logit so far ...
    best_i = tl.zeros([TILE], tl.int32)  # ... and where it first occurred
    for start in range(0, V, TILE):
        cols = start + tl.arange(0, TILE)
        inside = cols < V
        z = _transform(tl.load(base + cols, mask=inside, other=0.0).to(tl.float32), scale, softcap,
                       HAS_SCALE, HAS_SOFTCAP)
        z = tl.where(inside, z, float("-inf"))
        better = z > best_v  # strict: a lane keeps its first maximum
        best_i = tl.where(better, cols, best_i)
        best_v = tl.where(better, z, best_v)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    top = tl.max(best_v, 0)
    first = tl.min(tl.where(best_v == top, best_i, V), 0)  # the first maximum of the row
    zy = _transform(tl.load(base + y).to(tl.float32), scale, softcap, HAS_SCALE, HAS_SOFTCAP)
    tl.store(lse_ptr + row, m + tl.log(s))
    tl.store(zy_ptr + row, zy)
    tl.store(amax_ptr + row, first.to(tl.int64))


@triton.jit
def logit_grad_kernel(z_ptr, stride, labels_ptr, lse_ptr, coef_ptr, V, scale, softcap,
                      HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    y = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.load(coef_ptr + row)
    for start in range(0, V, TILE):
        cols = start + tl.arange(0, TILE)
        inside = cols < V
        z = _transform(tl.load(base + cols, mask=inside, other=0.0).to(tl.float32), scale, softcap,
                       HAS_SCALE, HAS_SOFTCAP)
        d = g * (tl.exp(z - lse) - tl.where(cols == y, 1.0, 0.0))
        if HAS_SOFTCAP:  # ∂(c·tanh(s·z_raw/c))/∂z_raw = s·(1 − (z/c)²)
            d = d * (scale * (1.0 - (z / softcap) * (z / softcap)))
        elif HAS_SCALE:
            d = d * scale
        tl.store(base + cols, d.to(z_ptr.dtype.element_ty), mask=inside)
