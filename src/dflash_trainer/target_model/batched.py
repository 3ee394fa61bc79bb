"""The frozen target decoding many sequences at once over a static per-row KV cache.

Shapes: R = rows (sequences decoded together), S = cache positions per row (`max_len`),
n = tokens run per row in one call, L = decoder layers, Hq / Hkv = query / key-value heads,
D = head_dim, H = hidden size, k = feature layers, V = vocabulary.

Why our own loop over the HF modules: batched generation and batched speculative verification
need, per row, its own length, its own write position and its own visible range, with no host
sync and no cache copies. Every row owns S cache slots; position p of row r lives in slot p.
A call that runs tokens at positions start_r … start_r+n−1 writes their keys and values into
those slots and attends over slots 0 … start_r+i (causal; sliding-window layers also need
(start_r+i) − j < W). Slots beyond a row's committed length hold stale keys from rejected
drafts; they are never visible (the causal bound excludes them) and the next write overwrites
them, so rejecting drafts costs nothing (no crop).

The layers are the HF model's own modules (projections, q/k norms, RoPE module, MLP, RMSNorms),
so numerics match the HF forward of Llama / Qwen2 / Qwen3 / Mistral-style decoders. The query
heads of a KV group are folded into extra query rows (no repeat of K/V). Prefill attends with
SDPA and a boolean mask. Steps over the cache (decode: 1 token per row, speculative verify: B
tokens) attend with two batched matmuls and a masked fp32 softmax (`cache_attention`): with G·n
query rows per (row, KV head) (3 when decoding SmolLM2), a fused attention kernel pads its query
tile and spends most of its time on padding, while a batched matmul reads each cached key and
value once, which is all a decode step needs. A verify round also materializes fp32 scores
[R, Hkv, G·B, span] (for a Qwen3-8B shape at B = 16: 64 query rows per KV head); its speed against
the fused kernel was not measured on a large target (regeneration speed: benchmarks/README.md). Checked against the HF
forward in tests/unit/test_batched_target.py.
"""

from __future__ import annotations

import sys
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


def right_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout `BatchedTarget.prefill` takes: tokens [m,P] long, right-padded with 0 to the
    longest prompt, and lengths [m] long, both on `device`."""
    toks = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.long)
    for r, p in enumerate(prompts):
        toks[r, :len(p)] = torch.tensor(p)
    return toks.to(device), torch.tensor([len(p) for p in prompts]).to(device)


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of a few queries per row over cached keys, by two batched matmuls.

    q [m,Hkv,M,D] (M = G·n query rows per KV head), keys / values [m,Hkv,K,D] (any strides with a
    unit last dimension; cache slices are read in place), visible [m,1,M,K] bool (every query row
    sees at least one key). Scores and softmax in fp32, probabilities cast to the values' dtype for
    the second matmul (as fused kernels do). Returns [m,Hkv,M,D] in the values' dtype.
    """
    scores = torch.matmul(q.to(keys.dtype), keys.transpose(-1, -2)).float() * scale  # [m,Hkv,M,K]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values)  # [m,Hkv,M,D]


def _layer_window(layer: nn.Module, config: Any) -> int | None:
    """Sliding window W of one HF decoder layer, None for full attention."""
    attn = layer.self_attn
    if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: set per layer from layer_types
        return attn.sliding_window
    if getattr(config, "model_type", "") == "mistral":  # every layer slides when set
        return getattr(config, "sliding_window", None)
    return None


class BatchedTarget:
    """R sequences of the frozen target over a static KV cache [L,R,Hkv,S,D] (see module docstring).

    layer_ids: target layers whose outputs are returned as features (id ℓ = output of decoder
    layer ℓ, as in training); None or [] = no features. Raises ValueError for a target outside
    SUPPORTED_MODEL_TYPES or whose layers are not Llama/Qwen-style (`unsupported_reason`).
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
        self._rope = sys.modules[type(attn0).__module__].apply_rotary_pos_emb
        self.windows = [_layer_window(layer, target.config) for layer in self.layers]
        self.layer_ids = check_target_layer_ids(layer_ids, target.num_layers) if layer_ids else []
        w = target.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        self.rows, self.max_len = rows, max_len
        shape = (len(self.layers), rows, self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self._row_index = torch.arange(rows, device=self.device)

    @property
    def feature_width(self) -> int:
        """k·H, the width of the returned features."""
        return len(self.layer_ids) * self.target.hidden_size

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
        pos = torch.arange(P, device=self.device).expand(m, P)  # [m,P]
        j = torch.arange(P, device=self.device)
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
        pos = start[:, None] + torch.arange(n, device=self.device)[None]  # [R,n]
        base = torch.arange(span, device=self.device)[None, None, :] <= pos[:, :, None]  # [R,n,span]
        hidden, feats = self._run(tokens, pos, self._row_index, base, keys_from_cache=True, span=span,
                                  with_features=with_features)
        return self._logits(hidden if all_logits else hidden[:, -1]), feats

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(self.base.norm(hidden)).float()

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, *,
             keys_from_cache: bool, with_features: bool, span: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layers over tokens [m,n] at positions pos [m,n], writing cache rows `rows`.

        visible: bool [m,n,K] causal visibility of the K keys (cache slots 0 … span−1, or the call's
        own n tokens when keys_from_cache is False); sliding layers narrow it by their window.
        """
        m, n = tokens.shape
        x = self.target.embed_tokens(tokens)  # [m,n,H]
        cos, sin = self.base.rotary_emb(x, pos)  # [m,n,D] ×2
        key_pos = torch.arange(visible.shape[-1], device=self.device)
        masks: dict[int | None, torch.Tensor] = {}
        G = self.q_heads // self.kv_heads
        feats = None
        if with_features:
            if not self.layer_ids:
                raise ValueError("with_features=True but no target layer ids were given")
            feats = torch.empty(m, n, self.feature_width, device=self.device, dtype=x.dtype)
        Hs = self.target.hidden_size
        for i, layer in enumerate(self.layers):
            W = self.windows[i]
            if W not in masks:
                vis = visible if W is None else visible & ((pos[:, :, None] - key_pos[None, None]) < W)
                masks[W] = vis[:, None].repeat(1, 1, G, 1).view(m, 1, G * n, -1)  # [m,1,G·n,K]
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(m, n, self.q_heads, self.head_dim)
            k = attn.k_proj(h).view(m, n, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(m, n, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [m,H*,n,D]
            v = v.transpose(1, 2)
            # every row writes its n keys at its own positions: cache[l][row, :, pos] = k
            self.k_cache[i][rows[:, None], :, pos] = k.transpose(1, 2).to(self.dtype)
            self.v_cache[i][rows[:, None], :, pos] = v.transpose(1, 2).to(self.dtype)
            if keys_from_cache:
                keys, values = self.k_cache[i][:, :, :span], self.v_cache[i][:, :, :span]  # [R,Hkv,span,D]
            else:
                keys, values = k, v
            qg = q.reshape(m, self.kv_heads, G * n, self.head_dim)  # query head h = kv·G + g
            if keys_from_cache:
                out = cache_attention(qg, keys, values, masks[W], self.scaling)  # [m,Hkv,G·n,D]
            else:
                out = F.scaled_dot_product_attention(qg.to(values.dtype), keys.to(values.dtype), values,
                                                     attn_mask=masks[W], scale=self.scaling)  # [m,Hkv,G·n,D]
            out = out.reshape(m, self.q_heads, n, self.head_dim).transpose(1, 2).reshape(m, n, -1)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if feats is not None and i in self.layer_ids:
                j = self.layer_ids.index(i)
                feats[:, :, j * Hs:(j + 1) * Hs] = x
        return x, feats
