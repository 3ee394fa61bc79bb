"""One target decoder layer as a static-cache step runs it, in few kernels (`BatchedTarget`,
decoding/batched.py, owns the cache and loops over the layers; the drafter's static cache,
decoding/draft.py, reuses the projection, norm and RoPE helpers).

Shapes: m = rows in one call, R = cache rows, S = cache positions per row, n = tokens per row,
Hq / Hkv = query / key-value heads, G = Hq / Hkv, Hh = Hq + 2·Hkv (the heads of one fused q/k/v
projection), D = head_dim, H = hidden size.

The math is the Llama / Qwen2 / Qwen3 / Mistral-style decoder layer's, and Gemma 3's (a norm after
each sublayer too), over the HF model's own weights and modules. The query heads of a KV group are
folded into extra query rows (no repeat of K/V).
Prefill attends with SDPA and a boolean mask (on CUDA without cuDNN attention: PREFILL_SDPA_BACKENDS). Steps
over the cache (decode: 1 token per row, speculative verify: B tokens) attend with SDPA and a boolean mask
too when the caller asks (`BatchedTarget` step_attention "sdpa", the decode engine's default for a bf16 /
fp16 target above one row: a verify of 16 tokens a row at 256 rows takes a quarter of the time), or over
each row's own slots (`row_span`: decoding/row_attention.py; step_attention "row", the regeneration's
default on CUDA), else with two batched matmuls and a masked fp32 softmax (`cache_attention`: fp32 targets,
one row). With G·n query rows per (row, KV head) (3 when decoding SmolLM2) a fused kernel pads its query
tile, while a batched matmul reads each cached key and value once; on an H100 with torch 2.11 the two take
the same time at one token a row, and a verify's fp32 scores [R, Hkv, G·B, span] make the matmuls 2.8× /
3.9× slower than SDPA at 64 / 256 rows (benchmarks/reports/2026-12-07-batch-rounds-short-blocks.md;
regeneration speed: benchmarks/reports/2026-12-02-regeneration-speed.md).

Kernels per layer. A decode step of a small target at batch 1 is a chain of tiny kernels (a CUDA
graph replays them back to back, each costing a few µs whatever its size), so the layer is written
in few of them, 20 per decode step for a Llama layer in bf16 (tests/unit/test_engine_kernels.py):
  RMSNorm          one `F.rms_norm` (HF: 8 ops); fp32 statistics, one rounding to the input dtype
                   where HF rounds the normalized value before the weight (same values in fp32);
                   Qwen3's q/k norms: one in-place op over both head groups (`head_rms_norm_`)
  q, k, v          one matmul over the three weights stored side by side (`fused_linear`; gate and
                   up of the MLP likewise)
  RoPE             rotate-half with the sign folded into the sin table (x·cos + swap(x)·sin': HF's
                   values exactly), over q, k and v heads at once with cos 1 / sin 0 for v heads, so
                   k and v leave it adjacent and one indexed write fills both caches (one tensor
                   [L, 2, R, Hkv, S, D]); cos / sin come from a table of every slot made once by the
                   model's own rotary module (static RoPE types, `RopeTables`); the output is laid out
                   head by head (`head_major`), so a verify step's queries need no copy at batch 1
  attention        "sdpa" (bf16 / fp16 decoding): one SDPA call with a boolean mask made once per
                   step; "cache" (fp32, one row, the regeneration's shared span): matmul, scale + mask
                   in one add of an additive fp32 mask made once per step, softmax, cast, matmul; "row"
                   (the regeneration on CUDA): decoding/row_attention.py over each row's own slots
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_trainer.decoding.row_attention import row_attention

# Prefill attention on CUDA: any SDPA backend but cuDNN's. On sm90 with a recent cuDNN, torch tries cuDNN
# attention first for a masked bf16 / fp16 call, and cuDNN builds an execution graph for every new problem
# shape (rows, query length, key length: tens of ms of host time each, then cached per shape). A prefill's
# shape is its group's (prompts, longest prompt), new for most groups of a continuous batch or a
# regeneration. On an H100 the speedup table's first streams ran 1.5–2× slower than the same streams
# repeated, with at most 11 new device allocations (none in the first speculative streams): consistent
# with one build per new shape (benchmarks/results/speedup-order_h100_2026-12-08*.json; the cause is
# inferred). The memory-efficient kernel takes a mask and builds nothing. Steps over the cache keep
# torch's choice: replayed from CUDA graphs, their shapes are fixed at capture (an eager step over a
# growing span, with graphs off, may still meet a new shape each step).
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Tokens per row up to which the RoPE tables are gathered per head of the fused q/k/v projection (one
# fused rotation); a longer forward (a prefill) rotates q and k by one broadcast table and copies v.
ROPE_PER_HEAD_MAX = 16


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of a few queries per row over cached keys, by two batched matmuls.

    q [m,Hkv,M,D] (M = G·n query rows per KV head), keys / values [m,Hkv,K,D] (any strides with a
    unit last dimension; cache slices are read in place), mask [m,1,M,K] fp32 additive (0 where
    visible, −inf elsewhere; every query row sees at least one key). Scores in the keys' dtype,
    scaled and masked in fp32 by one add (0 + s·scale is s·scale exactly, −inf stays −inf), softmax
    in fp32, probabilities cast to the values' dtype for the second matmul (as fused kernels do).
    Returns [m,Hkv,M,D] in the values' dtype.
    """
    scores = torch.matmul(q.to(keys.dtype), keys.transpose(-1, -2))  # [m,Hkv,M,K]
    probs = torch.softmax(torch.add(mask, scores, alpha=scale), dim=-1)  # fp32
    return torch.matmul(probs.to(values.dtype), values)  # [m,Hkv,M,D]


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin of HF's `apply_rotary_pos_emb`, with the sign of rotate_half folded
    into `sin` (its first half negated, `rope_pairs`): (−a)·b = a·(−b) in floating point, so the
    values are HF's exactly. x [..., D]; cos / sin broadcast to it; out: where to write (any
    strides, e.g. `head_major`), else a new tensor. Returns the result (`out` when given)."""
    h = x.shape[-1] // 2
    return torch.add(x * cos, torch.cat([x[..., h:], x[..., :h]], dim=-1) * sin, out=out)


def head_major(m: int, n: int, heads: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized [m,n,heads,D] view of a [m,heads,n,D] buffer (dtype and device of `like`):
    written token by token, read head by head, so a head range folds into [m,Hkv,G·n,D] query rows
    without a copy (at m = 1)."""
    return torch.empty(m, heads, n, d, dtype=like.dtype, device=like.device).transpose(1, 2)


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [..., D] → [..., 2, D] tables for `rotate_half_rope` (same dtype): index 0 = RoPE (cos,
    sin with its first half negated), index 1 = the identity (cos 1, sin 0) for heads that pass
    unrotated (v)."""
    h = cos.shape[-1] // 2
    signed = torch.cat([-sin[..., :h], sin[..., h:]], dim=-1)
    return (torch.stack([cos, torch.ones_like(cos)], dim=-2), torch.stack([signed, torch.zeros_like(sin)], dim=-2))


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """qkv [m,n,Hh,D] with its first `rotated` heads (q and k, Hq + Hkv) rotated and the rest (v) as
    is, in a new `head_major` buffer of qkv's dtype. cos / sin from `RopeTables.__call__`: [m,n,Hh,D]
    per head (one fused rotation, v heads the identity) or [m,n,1,D] (q and k rotated by one
    broadcast table, v copied)."""
    m, n, hh, d = qkv.shape
    y = head_major(m, n, hh, d, qkv)
    if cos.shape[2] == hh:
        return rotate_half_rope(qkv, cos, sin, out=y)
    rotate_half_rope(qkv[:, :, :rotated], cos, sin, out=y[:, :, :rotated])
    y[:, :, rotated:].copy_(qkv[:, :, rotated:])
    return y


class RopeTables:
    """cos / sin for the heads of a fused q/k/v projection, from the model's rotary module.

    rotary_emb: the HF rotary module, or a callable around it that fixes its layer type (called as
    rotary_emb(x, positions [1|m, n]) → cos, sin [.., n, D]); positions: every cache slot [S] long,
    on the cache's device; dtype: the probe's (the model's) dtype. static: the RoPE type allows a
    table made once (`batched.rope_is_static`); then `table` holds `rope_pairs` of every slot
    [S,2,D], else None and every call runs the module. Raises ValueError when the module's tables are narrower or wider than head_dim
    (partial RoPE).
    """

    def __init__(self, rotary_emb: nn.Module, positions: torch.Tensor, *, q_heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, static: bool):
        self.rotary_emb = rotary_emb
        # per head of a fused projection: 0 = rotated (q, k), 1 = passed through (v)
        self.head_kind = torch.tensor([0] * (q_heads + kv_heads) + [1] * kv_heads, device=positions.device)
        self.table = self._make_table(positions, head_dim, dtype) if static else None

    @torch.no_grad()
    def _make_table(self, positions: torch.Tensor, head_dim: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_pairs` of every slot [S,2,D], from the model's rotary module (values per position
        are the module's own, as computed per call)."""
        probe = torch.zeros(1, 1, device=positions.device, dtype=dtype)
        cos, sin = self.rotary_emb(probe, positions[None])  # [1,S,D]
        if cos.shape[-1] != head_dim:
            raise ValueError(f"rotary tables of width {cos.shape[-1]} for head_dim {head_dim}: partial RoPE is "
                             "not what the static-cache path implements")
        return rope_pairs(cos[0], sin[0])

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at positions pos [m,n] (long) for x [m,n,H] (the embeddings; only read by the
        module when there is no table): [m,n,Hh,D] per head (v heads the identity: one fused rotation
        of q, k and v) for up to ROPE_PER_HEAD_MAX tokens per row (decode steps, verify passes);
        beyond (a prefill), [m,n,1,D] for the q and k heads only, so the tables stay the size of one
        head (see `rotate_qkv`). dtype: the table's (the rotary module's output)."""
        per_head = pos.shape[1] <= ROPE_PER_HEAD_MAX
        if self.table is not None:
            cos_t, sin_t = self.table
            at = (pos[:, :, None], self.head_kind) if per_head else (pos[:, :, None], self.head_kind[:1])
            return cos_t[at], sin_t[at]
        cos_t, sin_t = rope_pairs(*self.rotary_emb(x, pos))  # [m,n,2,D]
        kind = self.head_kind if per_head else self.head_kind[:1]
        return cos_t[:, :, kind], sin_t[:, :, kind]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _side_by_side(params: list[torch.Tensor]) -> torch.Tensor:
    """One tensor whose leading-dim blocks are `params`' values. When they are not adjacent in one
    storage yet, they are moved into a new one and each parameter is pointed at its block (same
    values, same Parameter objects, no extra memory); later calls return a view of that storage."""
    shape = (sum(p.shape[0] for p in params), *params[0].shape[1:])
    ptr, offset = params[0].untyped_storage().data_ptr(), params[0].storage_offset()
    adjacent = True
    for p in params:
        adjacent = adjacent and p.is_contiguous() and p.untyped_storage().data_ptr() == ptr \
            and p.storage_offset() == offset
        offset += p.numel()
    if adjacent:
        return params[0].detach().as_strided(shape, _contiguous_stride(shape), params[0].storage_offset())
    joined = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = joined[start:start + p.shape[0]]
        start += p.shape[0]
    return joined


def fused_linear(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [ΣO, I], bias [ΣO] or None) computing the given linears' outputs side by side in one
    matmul, their weights sharing one storage (`_side_by_side`: the target's parameters are pointed
    at blocks of it, values unchanged, no extra memory). None when they cannot: not plain nn.Linear
    with plain frozen tensors, different dtype / device / input width, biases on some only."""
    if not linears or any(type(m) is not nn.Linear for m in linears):
        return None
    ws = [m.weight for m in linears]
    bs = [m.bias for m in linears]
    w0 = ws[0]
    for p in ws + [b for b in bs if b is not None]:
        if type(p.data) is not torch.Tensor or p.requires_grad or p.is_meta or p.dtype != w0.dtype \
                or p.device != w0.device:
            return None
    if any(w.dim() != 2 or w.shape[1] != w0.shape[1] for w in ws) or len({b is None for b in bs}) != 1:
        return None
    return _side_by_side(ws), (None if bs[0] is None else _side_by_side(bs))


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., heads, D], in place, each head with its own fp32 weight
    [heads, D] (the q_norm and k_norm heads of one fused projection at once): statistics and
    weight in fp32, one rounding to x's dtype (3 kernels for all heads; 2 in fp32). Returns x."""
    return torch.mul(F.rms_norm(x.float(), (x.shape[-1],), None, eps), weight, out=x)


class FusedNorm:
    """An HF RMSNorm (weight · x / rms(x), eps `variance_epsilon`) as one `F.rms_norm` (fp32
    statistics, output in x's dtype) when its weight has x's dtype; any other norm module (or
    dtype) runs as itself. Called on x [..., H]; returns the same shape.

    A module that has those attributes but computes something else (Gemma's (1 + w) · x / rms(x),
    say) is caught at construction: the module (in its weight's dtype) is compared once with an fp32
    `F.rms_norm` on 4 random rows (tolerance 1e-5 in fp32, 2e-2 in 16-bit dtypes; a host sync, at
    build time only), and the module runs as itself when they differ."""

    def __init__(self, module: nn.Module):
        self.module = module
        w, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        self.fast = isinstance(w, torch.Tensor) and w.dim() == 1 and isinstance(eps, float)
        self.eps = eps
        if self.fast:
            self.fast = self._computes_rms_norm()

    @torch.no_grad()
    def _computes_rms_norm(self) -> bool:
        w = self.module.weight
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(4, w.shape[0], generator=g).to(device=w.device, dtype=w.dtype)
        want = F.rms_norm(x.float(), (w.shape[0],), w.float(), self.eps)
        tol = 1e-5 if w.dtype == torch.float32 else 2e-2
        return bool(torch.allclose(self.module(x).float(), want, rtol=tol, atol=tol))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.module.weight if self.fast else None
        if w is not None and w.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return self.module(x)


class StaticLayer:
    """One decoder layer as a step runs it: norms, the q/k/v and gate/up projections fused where the
    weights allow (else the HF linears one by one), the MLP's activation from its module.

    layer: an HF Llama/Qwen-style decoder layer (self_attn with q/k/v/o_proj and optional q_norm /
    k_norm, mlp, input_layernorm, post_attention_layernorm; `batched.unsupported_reason` checks).
    A layer that also has pre_feedforward_layernorm and post_feedforward_layernorm (Gemma 3) runs as
    x + post_attention_layernorm(attn(input_layernorm(x))), then
    x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))), its norms being the modules
    themselves (Gemma's (1 + w) weight);
    q_heads / kv_heads / head_dim: the cache's head layout; scaling: the attention's score scale.
    Build under torch.no_grad(): the q/k/v (and gate/up) weights are moved into one storage
    (`fused_linear`).
    """

    def __init__(self, layer: nn.Module, *, q_heads: int, kv_heads: int, head_dim: int, scaling: float):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.q_heads, self.kv_heads, self.head_dim, self.scaling = q_heads, kv_heads, head_dim, scaling
        self.input_norm, self.post_norm = FusedNorm(layer.input_layernorm), FusedNorm(layer.post_attention_layernorm)
        # Gemma 3: norms around both sublayers (post_attention_layernorm then normalizes the attention's output)
        sandwich = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")
        self.ff_norms = ((FusedNorm(layer.pre_feedforward_layernorm), FusedNorm(layer.post_feedforward_layernorm))
                         if sandwich else None)
        self.q_norm = FusedNorm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = FusedNorm(attn.k_norm) if hasattr(attn, "k_norm") else None
        # q/k norms as one in-place op over both head groups: per-head fp32 weights [Hq+Hkv, D]
        self.qk_norm: tuple[torch.Tensor, float] | None = None
        if self.q_norm is not None and self.q_norm.fast and self.k_norm.fast and self.q_norm.eps == self.k_norm.eps:
            hq, hk = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
            w = torch.cat([attn.q_norm.weight.expand(hq, -1), attn.k_norm.weight.expand(hk, -1)]).float()
            self.qk_norm = (w, self.q_norm.eps)
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        gated = all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj]) if gated else None

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """h [m,n,H] → [m,n,(Hq+2Hkv)·D]: q, k, v projections side by side."""
        if self.qkv is not None:
            return F.linear(h, *self.qkv)
        return torch.cat([self.attn.q_proj(h), self.attn.k_proj(h), self.attn.v_proj(h)], dim=-1)

    def mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        """down(act(gate(h)) · up(h)), the HF gated MLP; the module itself when not fused. [m,n,H] → [m,n,H]."""
        if self.gate_up is None:
            return self.mlp(h)
        gate, up = F.linear(h, *self.gate_up).chunk(2, dim=-1)
        return self.mlp.down_proj(self.mlp.act_fn(gate) * up)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
             pos: torch.Tensor, mask: torch.Tensor | None, *, keys_from_cache: bool, span: int = 0,
             row_span: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The layer over x [m,n,H] (the residual stream, the model's dtype) at positions pos [m,n]
        (long); returns the next residual stream [m,n,H].

        cos / sin: `RopeTables` at pos. cache: this layer's keys and values [2,R,Hkv,S,D] (a view of
        the caller's cache); every row writes its n keys and values at cache[:, rows[r], :, pos[r]]
        (rows [m] long), cast to the cache's dtype. keys_from_cache: attend over cache slots
        0 … span−1 (`cache_attention`; mask [m,1,G·n,span] additive fp32, 0 / −inf); else over the
        call's own n tokens (a prefill: SDPA, on CUDA without cuDNN, PREFILL_SDPA_BACKENDS; mask
        [m,1,G·n,n] bool, True = visible); a bool mask with keys_from_cache attends over the cache slots by
        SDPA instead (`BatchedTarget` step_attention). Query row
        g·n + i of a KV head is token i's query head kv·G + g; at n = 1 the mask may have one query
        row ([m,1,1,K], broadcast). row_span: (start, end) [m] long, with keys_from_cache: each row's last
        token attends its own slots start … end − 1 instead, an earlier token i the same moved back by
        n − 1 − i (decoding/row_attention.py; the mask is then unused).
        """
        m, n = x.shape[:2]
        Hq, Hkv, D = self.q_heads, self.kv_heads, self.head_dim
        G = Hq // Hkv
        h = self.input_norm(x)
        qkv = self.project_qkv(h).view(m, n, Hq + 2 * Hkv, D)
        if self.qk_norm is not None:
            head_rms_norm_(qkv[:, :, :Hq + Hkv], *self.qk_norm)
        elif self.q_norm is not None:
            qkv = torch.cat([self.q_norm(qkv[:, :, :Hq]), self.k_norm(qkv[:, :, Hq:Hq + Hkv]),
                             qkv[:, :, Hq + Hkv:]], dim=2)
        y = rotate_qkv(qkv, cos, sin, Hq + Hkv)  # q, k rotated; v as is
        kv = y[:, :, Hq:].view(m, n, 2, Hkv, D)
        # every row writes its n keys and values at its own positions: cache[:, row, :, pos] = (k, v)
        cache[:, rows[:, None], :, pos] = kv.to(cache.dtype)
        qg = y[:, :, :Hq].transpose(1, 2).reshape(m, Hkv, G * n, D)  # query head h = kv·G + g
        if keys_from_cache and row_span is not None:
            if cache.shape[1] != m:  # the rows must be the cache's rows 0 … R−1 in order (BatchedTarget.step)
                raise ValueError(f"row attention over {m} rows of a {cache.shape[1]}-row cache: pass every row")
            out = row_attention(qg, cache[0], cache[1], *row_span, self.scaling, tokens=n)  # [m,Hkv,G·n,D]
        elif keys_from_cache and mask.dtype == torch.bool:  # BatchedTarget(step_attention="sdpa")
            out = F.scaled_dot_product_attention(qg.to(cache.dtype), cache[0, :, :, :span], cache[1, :, :, :span],
                                                 attn_mask=mask, scale=self.scaling)  # [m,Hkv,G·n,D]
        elif keys_from_cache:
            out = cache_attention(qg, cache[0, :, :, :span], cache[1, :, :, :span], mask,
                                  self.scaling)  # [m,Hkv,G·n,D]
        else:
            keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [m,Hkv,n,D]
            with sdpa_kernel(PREFILL_SDPA_BACKENDS) if x.is_cuda else nullcontext():  # no cuDNN graph per shape
                out = F.scaled_dot_product_attention(qg.to(values.dtype), keys.to(values.dtype), values,
                                                     attn_mask=mask, scale=self.scaling)  # [m,Hkv,G·n,D]
        out = out.reshape(m, Hq, n, D).transpose(1, 2).reshape(m, n, -1)
        if self.ff_norms is not None:
            pre_ff, post_ff = self.ff_norms
            x = x + self.post_norm(self.attn.o_proj(out))
            return x + post_ff(self.mlp_out(pre_ff(x)))
        x = x + self.attn.o_proj(out)
        return x + self.mlp_out(self.post_norm(x))
