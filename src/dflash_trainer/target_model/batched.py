"""The frozen target decoding many sequences at once over a static per-row KV cache.

Shapes: R = rows (sequences decoded together), S = cache positions per row (`max_len`),
n = tokens run per row in one call, L = decoder layers, Hq / Hkv = query / key-value heads,
Hh = Hq + 2·Hkv (the heads of one fused q/k/v projection), D = head_dim, H = hidden size,
k = feature layers, V = vocabulary.

Why our own loop over the HF modules: batched generation and batched speculative verification
need, per row, its own length, its own write position and its own visible range, with no host
sync and no cache copies. Every row owns S cache slots; position p of row r lives in slot p.
A call that runs tokens at positions start_r … start_r+n−1 writes their keys and values into
those slots and attends over slots 0 … start_r+i (causal; sliding-window layers also need
(start_r+i) − j < W). Slots beyond a row's committed length hold stale keys from rejected
drafts; they are never visible (the causal bound excludes them) and the next write overwrites
them, so rejecting drafts costs nothing (no crop).

The layers run the HF model's own weights and modules with the math of the Llama / Qwen2 / Qwen3 /
Mistral-style decoders. The query heads of a KV group are folded into extra query rows (no repeat
of K/V). Prefill attends with SDPA and a boolean mask. Steps over the cache (decode: 1 token per
row, speculative verify: B tokens) attend with two batched matmuls and a masked fp32 softmax
(`cache_attention`): with G·n query rows per (row, KV head) (3 when decoding SmolLM2), a fused
attention kernel pads its query tile and spends most of its time on padding, while a batched
matmul reads each cached key and value once, which is all a decode step needs. A verify round also
materializes fp32 scores [R, Hkv, G·B, span] (for a Qwen3-8B shape at B = 16: 64 query rows per KV
head); its speed against the fused kernel was not measured on a large target (regeneration speed:
benchmarks/README.md). Checked against the HF forward in tests/unit/test_batched_target.py.

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
                   model's own rotary module (static RoPE types); the output is laid out head by head
                   (`head_major`), so a verify step's queries need no copy at batch 1
  attention        matmul, scale + mask in one add of an additive fp32 mask made once per step,
                   softmax, cast, matmul
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.target_model.layers import check_target_layer_ids
from dflash_trainer.target_model.load import TargetBundle, find_base_model

_REQUIRED = ("q_proj", "k_proj", "v_proj", "o_proj")
# Decoder families whose layer is exactly: x + attn(input_layernorm(x)); x + mlp(post_attention_layernorm(x)),
# with rotate-half RoPE, optional q/k norms and projection biases (others, e.g. Gemma's extra norms and
# softcapping, would run with the wrong math).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(target: TargetBundle) -> str | None:
    """Why `BatchedTarget` cannot run this target, or None when it can."""
    model_type = str(getattr(target.config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)} (the decoder families "
                "the batched static-cache path implements)")
    base = find_base_model(target.model)
    if not hasattr(base, "rotary_emb") or not hasattr(base, "norm"):
        return f"{type(base).__name__}: no rotary_emb / norm module"
    for i, layer in enumerate(base.layers):
        attn = getattr(layer, "self_attn", None)
        parts = ("mlp", "input_layernorm", "post_attention_layernorm")
        if attn is None or not all(hasattr(attn, a) for a in _REQUIRED) or not all(hasattr(layer, a) for a in parts):
            return f"target layer {i} ({type(layer).__name__}) is not a Llama/Qwen-style decoder layer"
    return None


def rope_is_static(base: Any) -> bool:
    """False for HF RoPE types that rebuild their tables from a host-side read of the positions
    ("dynamic", "longrope": a data-dependent branch, which neither a CUDA graph nor a table made
    once can hold)."""
    rope_type = str(getattr(base.rotary_emb, "rope_type", "default"))
    return "dynamic" not in rope_type and rope_type != "longrope"


def right_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout `BatchedTarget.prefill` takes: tokens [m,P] long, right-padded with 0 to the
    longest prompt, and lengths [m] long, both on `device`."""
    toks = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.long)
    for r, p in enumerate(prompts):
        toks[r, :len(p)] = torch.tensor(p)
    return toks.to(device), torch.tensor([len(p) for p in prompts]).to(device)


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
    strides, e.g. `head_major`), else a new tensor."""
    h = x.shape[-1] // 2
    return torch.add(x * cos, torch.cat([x[..., h:], x[..., :h]], dim=-1) * sin, out=out)


def head_major(m: int, n: int, heads: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized [m,n,heads,D] view of a [m,heads,n,D] buffer: written token by token, read
    head by head, so a head range folds into [m,Hkv,G·n,D] query rows without a copy (at m = 1)."""
    return torch.empty(m, heads, n, d, dtype=like.dtype, device=like.device).transpose(1, 2)


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [..., D] → [..., 2, D] tables for `rotate_half_rope`: index 0 = RoPE (cos, sin with its
    first half negated), index 1 = the identity (cos 1, sin 0) for heads that pass unrotated (v)."""
    h = cos.shape[-1] // 2
    signed = torch.cat([-sin[..., :h], sin[..., h:]], dim=-1)
    return (torch.stack([cos, torch.ones_like(cos)], dim=-2), torch.stack([signed, torch.zeros_like(sin)], dim=-2))


# Tokens per row up to which the RoPE tables are gathered per head of the fused q/k/v projection (one
# fused rotation); a longer forward (a prefill) rotates q and k by one broadcast table and copies v.
ROPE_PER_HEAD_MAX = 16


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


class _Norm:
    """An HF RMSNorm (weight · x / rms(x), eps `variance_epsilon`) as one `F.rms_norm` (fp32
    statistics, output in x's dtype); any other norm module runs as itself."""

    def __init__(self, module: nn.Module):
        self.module = module
        w, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        self.fast = isinstance(w, torch.Tensor) and w.dim() == 1 and isinstance(eps, float)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.module.weight if self.fast else None
        if w is not None and w.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return self.module(x)


class _Layer:
    """One decoder layer as a step runs it: norms, the q/k/v and gate/up projections fused where the
    weights allow (else the HF linears one by one), the MLP's activation from its module."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = _Norm(layer.input_layernorm), _Norm(layer.post_attention_layernorm)
        self.q_norm = _Norm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = _Norm(attn.k_norm) if hasattr(attn, "k_norm") else None
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
        """[m,n,(Hq+2Hkv)·D]: q, k, v projections side by side."""
        if self.qkv is not None:
            return F.linear(h, *self.qkv)
        return torch.cat([self.attn.q_proj(h), self.attn.k_proj(h), self.attn.v_proj(h)], dim=-1)

    def mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        """down(act(gate(h)) · up(h)), the HF gated MLP; the module itself when not fused."""
        if self.gate_up is None:
            return self.mlp(h)
        gate, up = F.linear(h, *self.gate_up).chunk(2, dim=-1)
        return self.mlp.down_proj(self.mlp.act_fn(gate) * up)


class BatchedTarget:
    """R sequences of the frozen target over a static KV cache [L,2,R,Hkv,S,D] (see module docstring;
    `k_cache` / `v_cache` are its halves).

    layer_ids: target layers whose outputs are returned as features (id ℓ = output of decoder
    layer ℓ, as in training); None or [] = no features. Raises ValueError for a target outside
    SUPPORTED_MODEL_TYPES or whose layers are not Llama/Qwen-style (`unsupported_reason`).
    The target's q/k/v (and gate/up) weights are moved into one storage per layer (`fused_linear`).
    """

    def __init__(self, target: TargetBundle, *, rows: int, max_len: int, layer_ids: list[int] | None = None):
        self.target = target
        self.base = find_base_model(target.model)
        self.layers = self.base.layers
        reason = unsupported_reason(target)
        if reason:
            raise ValueError(f"static-cache decoding: {reason}; `eval` and measured τ decode only on this path: "
                             "use a target of those families (regenerate falls back to HF generate by itself)")
        attn0 = self.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.kv_heads = attn0.k_proj.out_features // self.head_dim
        self.q_heads = attn0.q_proj.out_features // self.head_dim
        self.scaling = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.windows = [_layer_window(layer, target.config) for layer in self.layers]
        self.layer_ids = check_target_layer_ids(layer_ids, target.num_layers) if layer_ids else []
        w = target.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        self.rows, self.max_len = rows, max_len
        with torch.no_grad():
            self._layers = [_Layer(layer) for layer in self.layers]
        shape = (len(self.layers), 2, rows, self.kv_heads, max_len, self.head_dim)
        self.kv_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.k_cache, self.v_cache = self.kv_cache[:, 0], self.kv_cache[:, 1]  # [L,R,Hkv,S,D] views
        self._row_index = torch.arange(rows, device=self.device)
        self._positions = torch.arange(max_len, device=self.device)
        self._zero, self._neg_inf = (torch.full((), v, device=self.device) for v in (0.0, float("-inf")))  # fp32
        # per head of a fused projection: 0 = rotated (q, k), 1 = passed through (v)
        self._head_kind = torch.tensor([0] * (self.q_heads + self.kv_heads) + [1] * self.kv_heads, device=self.device)
        self._rope_table = self._make_rope_table() if rope_is_static(self.base) else None
        self._final_norm = _Norm(self.base.norm)

    @property
    def feature_width(self) -> int:
        """k·H, the width of the returned features."""
        return len(self.layer_ids) * self.target.hidden_size

    @torch.no_grad()
    def _make_rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_pairs` of every slot [S,2,D], from the model's rotary module (values per position
        are the module's own, as computed per call)."""
        probe = torch.zeros(1, 1, device=self.device, dtype=self.dtype)
        cos, sin = self.base.rotary_emb(probe, self._positions[None])  # [1,S,D]
        if cos.shape[-1] != self.head_dim:
            raise ValueError(f"rotary tables of width {cos.shape[-1]} for head_dim {self.head_dim}: partial RoPE is "
                             "not what the static-cache path implements")
        return rope_pairs(cos[0], sin[0])

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the heads of a fused projection at positions pos [m,n]: [m,n,Hh,D] per head
        (v heads the identity: one fused rotation of q, k and v) for up to ROPE_PER_HEAD_MAX tokens
        per row (decode steps, verify passes); beyond (a prefill), [m,n,1,D] for the q and k heads
        only, so the tables stay the size of one head (see `_rotate`)."""
        per_head = pos.shape[1] <= ROPE_PER_HEAD_MAX
        if self._rope_table is not None:
            cos_t, sin_t = self._rope_table
            at = (pos[:, :, None], self._head_kind) if per_head else (pos[:, :, None], self._head_kind[:1])
            return cos_t[at], sin_t[at]
        cos_t, sin_t = rope_pairs(*self.base.rotary_emb(x, pos))  # [m,n,2,D]
        kind = self._head_kind if per_head else self._head_kind[:1]
        return cos_t[:, :, kind], sin_t[:, :, kind]

    def _rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qkv [m,n,Hh,D] with q and k rotated and v as is, in a `head_major` buffer; cos / sin from `_rope`."""
        m, n, hh, d = qkv.shape
        y = head_major(m, n, hh, d, qkv)
        if cos.shape[2] == hh:
            return rotate_half_rope(qkv, cos, sin, out=y)
        qk = self.q_heads + self.kv_heads
        rotate_half_rope(qkv[:, :, :qk], cos, sin, out=y[:, :, :qk])
        y[:, :, qk:].copy_(qkv[:, :, qk:])
        return y

    @torch.no_grad()
    def prefill(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, *,
                with_features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Start new sequences in cache rows `rows` [m] (long) from their prompts.

        tokens: [m,P] long, right-padded (row i holds lengths[i] ≥ 1 real tokens at positions
        0 … lengths[i]−1). Returns (logits fp32 [m,V] of each prompt's last token, features
        [m,P,k·H] in the target dtype or None). Padding positions get stale cache entries that
        stay invisible.
        """
        m, P = tokens.shape
        if P > self.max_len:
            raise ValueError(f"prompt of {P} tokens exceeds the cache length {self.max_len}")
        pos = self._positions[:P].expand(m, P)  # [m,P]
        j = self._positions[:P]
        # causal within the prompt; padding queries also see themselves (never an empty row -> no NaN)
        base = ((j[None, :] <= j[:, None])[None] & (j[None, None, :] < lengths[:, None, None])) | torch.eye(
            P, dtype=torch.bool, device=self.device)[None]  # [m,P,P]
        hidden, feats = self._run(tokens, pos, rows, base, keys_from_cache=False, with_features=with_features)
        last = hidden[torch.arange(m, device=self.device), lengths - 1]  # [m,H]
        return self._logits(last), feats

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, start: torch.Tensor, span: int, *, with_features: bool = False,
             all_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens [R,n] at positions start[r] … start[r]+n−1 on every row, over its cache.

        span: number of cache slots attended (≥ max(start) + n, ≤ max_len; a host-side bound so
        no sync is needed). Returns (logits fp32 [R,n,V], or [R,V] of the last token when
        all_logits is False; features [R,n,k·H] or None).
        """
        R, n = tokens.shape
        if span > self.max_len:
            raise ValueError(f"span {span} exceeds the cache length {self.max_len}")
        pos = start[:, None] + self._positions[:n][None]  # [R,n]
        base = self._positions[:span][None, None, :] <= pos[:, :, None]  # [R,n,span]
        hidden, feats = self._run(tokens, pos, self._row_index, base, keys_from_cache=True, span=span,
                                  with_features=with_features)
        return self._logits(hidden if all_logits else hidden[:, -1]), feats

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(self._final_norm(hidden)).float()

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, *,
             keys_from_cache: bool, with_features: bool, span: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layers over tokens [m,n] at positions pos [m,n], writing cache rows `rows`.

        visible: bool [m,n,K] causal visibility of the K keys (cache slots 0 … span−1, or the call's
        own n tokens when keys_from_cache is False); sliding layers narrow it by their window.
        """
        m, n = tokens.shape
        Hq, Hkv, D = self.q_heads, self.kv_heads, self.head_dim
        G = Hq // Hkv
        x = self.target.embed_tokens(tokens)  # [m,n,H]
        cos, sin = self._rope(x, pos)  # [m,n,Hh,D]
        key_pos = self._positions[:visible.shape[-1]]
        masks: dict[int | None, torch.Tensor] = {}
        feats = None
        if with_features:
            if not self.layer_ids:
                raise ValueError("with_features=True but no target layer ids were given")
            feats = torch.empty(m, n, self.feature_width, device=self.device, dtype=x.dtype)
        Hs = self.target.hidden_size
        for i, layer in enumerate(self._layers):
            W = self.windows[i]
            if W not in masks:
                vis = visible if W is None else visible & ((pos[:, :, None] - key_pos[None, None]) < W)
                # [m,1,G·n,K] (query row g·n + i sees what token i sees); one token: [m,1,1,K], broadcast
                vis = vis[:, None] if n == 1 else vis[:, None].repeat(1, 1, G, 1).view(m, 1, G * n, -1)
                # steps: additive fp32 (cache_attention); prefill: boolean (SDPA)
                masks[W] = torch.where(vis, self._zero, self._neg_inf) if keys_from_cache else vis
            h = layer.input_norm(x)
            qkv = layer.project_qkv(h).view(m, n, Hq + 2 * Hkv, D)
            if layer.qk_norm is not None:
                head_rms_norm_(qkv[:, :, :Hq + Hkv], *layer.qk_norm)
            elif layer.q_norm is not None:
                qkv = torch.cat([layer.q_norm(qkv[:, :, :Hq]), layer.k_norm(qkv[:, :, Hq:Hq + Hkv]),
                                 qkv[:, :, Hq + Hkv:]], dim=2)
            y = self._rotate(qkv, cos, sin)  # q, k rotated; v as is
            kv = y[:, :, Hq:].view(m, n, 2, Hkv, D)
            # every row writes its n keys and values at its own positions: cache[l][:, row, :, pos] = (k, v)
            self.kv_cache[i][:, rows[:, None], :, pos] = kv.to(self.dtype)
            qg = y[:, :, :Hq].transpose(1, 2).reshape(m, Hkv, G * n, D)  # query head h = kv·G + g
            if keys_from_cache:
                out = cache_attention(qg, self.kv_cache[i, 0, :, :, :span], self.kv_cache[i, 1, :, :, :span],
                                      masks[W], self.scaling)  # [m,Hkv,G·n,D]
            else:
                keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [m,Hkv,n,D]
                out = F.scaled_dot_product_attention(qg.to(values.dtype), keys.to(values.dtype), values,
                                                     attn_mask=masks[W], scale=self.scaling)  # [m,Hkv,G·n,D]
            out = out.reshape(m, Hq, n, D).transpose(1, 2).reshape(m, n, -1)
            x = x + layer.attn.o_proj(out)
            x = x + layer.mlp_out(layer.post_norm(x))
            if feats is not None and i in self.layer_ids:
                j = self.layer_ids.index(i)
                feats[:, :, j * Hs:(j + 1) * Hs] = x
        return x, feats


def _layer_window(layer: nn.Module, config: Any) -> int | None:
    """Sliding window W of one HF decoder layer, None for full attention."""
    attn = layer.self_attn
    if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: set per layer from layer_types
        return attn.sliding_window
    if getattr(config, "model_type", "") == "mistral":  # every layer slides when set
        return getattr(config, "sliding_window", None)
    return None
