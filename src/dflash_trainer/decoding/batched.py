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

The layers (decoding/static_layer.py: fused projections, norms, RoPE tables, the attention of
a prefill and of a step over the cache, in few kernels per layer) run the HF model's own weights and
modules with the math of the Llama / Qwen2 / Qwen3 / Mistral-style decoders and of Gemma 3's (norms
around both sublayers, scaled embeddings, a RoPE table per layer type); this module owns the cache,
the masks of a call (causal, per sliding window), the RoPE tables, the target's logits function and
the loop over the layers. Checked against the HF forward in tests/unit/test_batched_target.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from dflash_trainer.target_model.shared_head import transform_logits
from dflash_trainer.target_model.head_transforms import target_head
from dflash_trainer.config.sections import check_layer_ids
from dflash_trainer.target_model.load import TargetBundle, find_base_model
from dflash_trainer.decoding.static_layer import FusedNorm, RopeTables, StaticLayer

_REQUIRED = ("q_proj", "k_proj", "v_proj", "o_proj")
# Decoder families whose layer is x + attn(input_layernorm(x)); x + mlp(post_attention_layernorm(x)), with
# rotate-half RoPE, optional q/k norms and projection biases; Gemma 3 adds a norm after each sublayer
# (`StaticLayer` reads them from the layer). Others (Gemma 2's attention soft-capping, gpt-oss's sinks, MLA,
# state-space layers) would run with the wrong math: they decode with the HF model's own forward.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# The decoder layer's modules, per family (the default: Llama / Qwen / Mistral)
_LAYER_PARTS = {"gemma3_text": ("mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                "post_feedforward_layernorm")}
_DEFAULT_PARTS = ("mlp", "input_layernorm", "post_attention_layernorm")


def unsupported_reason(target: TargetBundle) -> str | None:
    """Why `BatchedTarget` cannot run this target, or None when it can."""
    cfg = target.config
    model_type = str(getattr(cfg, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)} (the decoder families "
                "the batched static-cache path implements)")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return f"{model_type}: attn_logit_softcapping={cfg.attn_logit_softcapping} (the static-cache attention does not soft-cap)"
    if getattr(cfg, "use_bidirectional_attention", False):
        return f"{model_type}: use_bidirectional_attention=True (the static-cache path decodes causally)"
    base = find_base_model(target.model)
    if not hasattr(base, "rotary_emb") or not hasattr(base, "norm"):
        return f"{type(base).__name__}: no rotary_emb / norm module"
    try:
        rope_keys(base, cfg)
    except ValueError as e:
        return str(e)
    parts = _LAYER_PARTS.get(model_type, _DEFAULT_PARTS)
    for i, layer in enumerate(base.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in _REQUIRED) or not all(hasattr(layer, a) for a in parts):
            return f"target layer {i} ({type(layer).__name__}) lacks one of {', '.join(parts)} or q/k/v/o_proj"
    return None


def rope_is_static(base: Any) -> bool:
    """False for HF RoPE types that rebuild their tables from a host-side read of the positions
    ("dynamic", "longrope": a data-dependent branch, which neither a CUDA graph nor a table made
    once can hold); a rotary module with a type per layer type (Gemma 3: a dict) is static when
    every type is."""
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return all("dynamic" not in str(t) and str(t) != "longrope" for t in types)


def rope_keys(base: Any, config: Any) -> list[str | None]:
    """Per decoder layer, which RoPE table it reads: its entry of config.layer_types when the rotary
    module is called per layer type (Gemma 3: local and global layers rotate with different bases),
    else None (one table for every layer)."""
    if "layer_type" not in inspect.signature(base.rotary_emb.forward).parameters:
        return [None] * len(base.layers)
    types = getattr(config, "layer_types", None)
    if not types or len(types) < len(base.layers):
        raise ValueError(f"{type(base.rotary_emb).__name__} takes a layer_type, but config.layer_types is "
                         f"{types!r}: one entry per decoder layer is needed")
    return [str(t) for t in types[:len(base.layers)]]


def right_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout `BatchedTarget.prefill` takes: tokens [m,P] long, right-padded with 0 to the
    longest prompt, and lengths [m] long, both on `device`."""
    toks = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.long)
    for r, p in enumerate(prompts):
        toks[r, :len(p)] = torch.tensor(p)
    return toks.to(device), torch.tensor([len(p) for p in prompts]).to(device)


# rows × longest prompt P of one prefill forward: its features grow with it, its attention mask and scores
# with rows × P² (so, at this budget, linearly in P), so a batch of long prompts is prefilled in groups (one
# row alone may exceed it; eval's --max-prompt-tokens bounds P)
PREFILL_TOKENS = 32768
# How a step over the cache (decode, verify) attends: "cache" = two batched matmuls and an fp32 softmax
# (static_layer.cache_attention), "sdpa" = torch's fused attention with a boolean mask. The H100 table of
# 2026-12-07 (benchmarks/results/profile-batch-b16-blocks-k1_h100_2026-12-07.json): equal at one token a row (batch 1,
# 1,024 rows), SDPA 2.8× / 3.9× faster for a verify of 16 tokens at 64 / 256 rows (bf16; that table passed an
# additive bf16 mask, the engine passes a boolean one). "row" = each row over its own slots only
# (decoding/row_attention.py, the Triton kernel on CUDA; the torch path elsewhere reads every slot), a block of
# n tokens causal within it; the regeneration's continuous batch asks for it per step (`step(row_attention=True)`).
# The decode engine chooses per dtype and rows (default_step_attention).
STEP_ATTENTION = ("cache", "sdpa", "row")


def default_step_attention(dtype: torch.dtype, rows: int) -> str:
    """The decode engine's step attention (STEP_ATTENTION) for a target in `dtype` decoding
    `rows` rows at once: "cache" for fp32 (the exact lossless check, the CPU: SDPA's fp32 kernel was 2.2×
    slower at batch 1) and for one row (bf16 on an H100, 2026-12-07: plain step 1.71 ms against SDPA's 1.83,
    round 2.54 against 2.65; benchmarks/results/engine-b1-step-attention_h100_2026-12-07.json), "sdpa"
    for bf16 / fp16 at more rows (a round at 64 rows 15 % faster than "cache", speculative tokens equal to
    the plain ones on every row: benchmarks/reports/2026-12-07-batch-rounds-short-blocks.md; 2 … 63 rows
    are not measured). "row" is chosen by name only: its kernel is measured per op, not in the engine."""
    return "cache" if dtype == torch.float32 or rows == 1 else "sdpa"


def check_step_attention(name: str) -> str:
    """`name` itself when it is one of STEP_ATTENTION, else ValueError naming step_attention and the choices."""
    if name not in STEP_ATTENTION:
        raise ValueError(f"step_attention={name!r}: use one of {', '.join(STEP_ATTENTION)}")
    return name


def prefill_groups(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive [i, j) ranges of the prompts (in the given order) such that (j − i) × max(lengths[i:j])
    ≤ budget, each holding at least one prompt; callers sort by length so that a group's prompts are
    alike (the continuous batch's refill and the decode engine's start both do). E.g. lengths
    [10, 10, 30, 30], budget 60 → [(0, 2), (2, 4)]."""
    groups, i = [], 0
    while i < len(lengths):
        j, longest = i + 1, lengths[i]
        while j < len(lengths) and (j + 1 - i) * max(longest, lengths[j]) <= budget:
            longest = max(longest, lengths[j])
            j += 1
        groups.append((i, j))
        i = j
    return groups


class BatchedTarget:
    """R sequences of the frozen target over a static KV cache [L,2,R,Hkv,S,D] (see module docstring;
    `k_cache` / `v_cache` are its halves).

    layer_ids: target layers whose outputs are returned as features (id ℓ = output of decoder
    layer ℓ, as in training); None or [] = no features. step_attention: how steps over the cache
    attend (STEP_ATTENTION). Raises ValueError for a bad step_attention, a target outside
    SUPPORTED_MODEL_TYPES or whose layers are not Llama/Qwen-style (`unsupported_reason`), and for
    rotary tables whose width is not head_dim (partial RoPE, `RopeTables`). The target's q/k/v (and
    gate/up) weights are moved into one storage per layer (`static_layer.fused_linear`); each layer
    runs as a `StaticLayer` over its slice `kv_cache[ℓ]` [2,R,Hkv,S,D].
    """

    def __init__(self, target: TargetBundle, *, rows: int, max_len: int, layer_ids: list[int] | None = None,
                 step_attention: str = "cache"):
        self.step_attention = check_step_attention(step_attention)
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
        self.layer_ids = check_layer_ids(layer_ids, target.num_layers) if layer_ids else []
        w = target.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        self.rows, self.max_len = rows, max_len
        with torch.no_grad():
            self._layers = [StaticLayer(layer, q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                        scaling=self.scaling) for layer in self.layers]
        shape = (len(self.layers), 2, rows, self.kv_heads, max_len, self.head_dim)
        self.kv_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.k_cache, self.v_cache = self.kv_cache[:, 0], self.kv_cache[:, 1]  # [L,R,Hkv,S,D] views
        self._row_index = torch.arange(rows, device=self.device)
        self._positions = torch.arange(max_len, device=self.device)
        self._zero, self._neg_inf = (torch.full((), v, device=self.device) for v in (0.0, float("-inf")))  # fp32
        self._rope_keys = rope_keys(self.base, target.config)
        static = rope_is_static(self.base)
        self._ropes = {key: RopeTables(self._rotary(key), self._positions, q_heads=self.q_heads,
                                       kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype, static=static)
                       for key in dict.fromkeys(self._rope_keys)}
        self._final_norm = FusedNorm(self.base.norm)
        head = target_head(target.model)  # Gemma: final_logit_softcapping; Llama / Qwen: identity
        self._logit_scale, self._logit_softcap = head.logit_scale, head.logit_softcap

    def _rotary(self, key: str | None):
        """The rotary module as RopeTables calls it, (x, positions) → cos, sin, for layers of type `key`."""
        rotary = self.base.rotary_emb
        return rotary if key is None else (lambda x, pos: rotary(x, pos, layer_type=key))

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
             all_logits: bool = True, row_attention: bool = False,
             greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens [R,n] at positions start[r] … start[r]+n−1 on every row, over its cache.

        span: number of cache slots attended (≥ max(start) + n, ≤ max_len; a host-side bound so
        no sync is needed). row_attention (or step_attention "row"): each row attends only its own
        slots (its window, or 0 … its position, causal within its n tokens; decoding/row_attention.py), span
        then unused. greedy: the caller only takes
        the argmax, so the logits stay in the model's dtype (the fp32 ones are an exact copy of them:
        the same argmax, without a [R,n,V] conversion). Returns (logits fp32 [R,n,V], or [R,V] of the
        last token when all_logits is False, in the model's dtype when greedy; features [R,n,k·H] or
        None). Raises ValueError for a span past the cache.
        """
        R, n = tokens.shape
        if span > self.max_len:
            raise ValueError(f"span {span} exceeds the cache length {self.max_len}")
        row_attention = row_attention or self.step_attention == "row"
        pos = start[:, None] + self._positions[:n][None]  # [R,n]
        base = None if row_attention else self._positions[:span][None, None, :] <= pos[:, :, None]  # [R,n,span]
        hidden, feats = self._run(tokens, pos, self._row_index, base, keys_from_cache=True, span=span,
                                  with_features=with_features)
        return self._logits(hidden if all_logits else hidden[:, -1], as_float=not greedy), feats

    def _logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        """Final norm, LM head and the target's logits transform (`head_transforms.target_head`), in the
        model's dtype as HF applies it: hidden [..., H] → logits [..., V], then fp32 when as_float."""
        logits = transform_logits(self.target.lm_head(self._final_norm(hidden)), self._logit_scale, self._logit_softcap)
        return logits.float() if as_float else logits

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, *,
             keys_from_cache: bool, with_features: bool, span: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layers over tokens [m,n] (long) at positions pos [m,n], writing cache rows `rows` [m].

        visible: bool [m,n,K] causal visibility of the K keys (cache slots 0 … span−1, or the call's
        own n tokens when keys_from_cache is False); sliding layers narrow it by their window (one
        mask per window, shared by its layers). visible None (a step with keys from the cache): each
        row attends its own slots, its last token max(0, pos − W + 1) … pos and each earlier token of
        the block the same moved back (row_attention.py).
        Returns (last hidden states [m,n,H] before the final norm, features [m,n,k·H] or None), both
        in the target dtype. Raises ValueError for with_features without layer ids.
        """
        m, n = tokens.shape
        G = self.q_heads // self.kv_heads
        x = self.target.embed_tokens(tokens)  # [m,n,H] (the model's module: Gemma scales its rows)
        rope = {key: tables(x, pos) for key, tables in self._ropes.items()}  # cos, sin [m,n,Hh,D] per table
        key_pos = self._positions[:visible.shape[-1]] if visible is not None else None
        masks: dict[int | None, torch.Tensor] = {}
        row_spans: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        feats = None
        if with_features:
            if not self.layer_ids:
                raise ValueError("with_features=True but no target layer ids were given")
            feats = torch.empty(m, n, self.feature_width, device=self.device, dtype=x.dtype)
        Hs = self.target.hidden_size
        for i, layer in enumerate(self._layers):
            W = self.windows[i]
            if visible is None:
                if W not in row_spans:  # the last token at pos: slots max(0, pos − W + 1) … pos
                    p = pos[:, -1]
                    row_spans[W] = ((p - W + 1).clamp(min=0) if W is not None else torch.zeros_like(p), p + 1)
                x = layer.step(x, *rope[self._rope_keys[i]], self.kv_cache[i], rows, pos, None,
                               keys_from_cache=True, row_span=row_spans[W])
            else:
                if W not in masks:
                    vis = visible if W is None else visible & ((pos[:, :, None] - key_pos[None, None]) < W)
                    # [m,1,G·n,K] (query row g·n + i sees what token i sees); one token: [m,1,1,K], broadcast
                    vis = vis[:, None] if n == 1 else vis[:, None].repeat(1, 1, G, 1).view(m, 1, G * n, -1)
                    # steps: additive fp32 (cache_attention) or boolean (step_attention "sdpa"); prefill: boolean
                    additive = keys_from_cache and self.step_attention == "cache"
                    masks[W] = torch.where(vis, self._zero, self._neg_inf) if additive else vis
                x = layer.step(x, *rope[self._rope_keys[i]], self.kv_cache[i], rows, pos, masks[W],
                               keys_from_cache=keys_from_cache, span=span)
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
