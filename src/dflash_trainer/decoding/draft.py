"""The drafter at inference: static per-row context K/V, one block per row and round (R ≥ 1 rows).

Shapes: R = rows, S = context slots per row (`max_len`), B = block size, k·H = feature width,
Hq / Hkv = query / key-value heads, Hh = Hq + 2·Hkv, D = head_dim, L = drafter layers,
V = vocabulary.

Semantics are training's (docs/architecture.md "Semantics", `drafter/blocks.py`): the block anchored at position
a_r is `[anchor token, MASK × (B−1)]` at positions a_r … a_r+B−1; it sees the target features of
every context position p < a_r (sliding layers also (a_r+k) − p < W) and its whole own block, and
slot k predicts the token at a_r+k. At inference the anchor is the last committed token, whose own
features are not known yet. Context keys/values (`k_norm(k_proj(C))` rotated at p, `v_proj(C)`,
with C = hidden_norm(fc(features))) depend only on the features and p, never on the block, so
they are computed once when written and reused by every later round; a round costs the block's B
queries over span + B keys per layer. Like the target's static cache, a write of n positions at
start_r fills slots start_r … start_r+n−1; slots at or past a row's anchor are never visible as
context, so features of rejected drafts need no removal. Checked against `DFlashDrafter.forward`
with the dense training mask in tests/unit/test_eval_draft.py.

Few kernels per round (at batch 1 the drafter is a chain of tiny kernels), with the helpers of
decoding/static_layer.py: one cache [2, L, R, Hkv, S, D] for the keys and values of every layer;
`extend` projects, normalizes and writes the context of all layers at once (k_proj / v_proj of
every layer stacked by `refresh`); `propose` writes the block's own keys and values into slots
a … a+B−1 (past the context, so never visible as context: the round's `extend` rewrites slots
a … a+k with the verified context, and the slots past a+k lie at or beyond the next anchor, masked until
a later round's `propose` or `extend` writes them) and attends over slots 0 … span+B−1 in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.drafter.layers import rope_cos_sin
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.decoding.static_layer import (fused_linear, head_major, head_rms_norm_, rope_pairs,
                                                       rotate_half_rope)


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The drafter's RMSNorm module `norm` (drafter/layers.py: fp32 statistics and weight, output in
    x's dtype) in one op where the weight has x's dtype."""
    return norm(x) if norm.weight.dtype != x.dtype else F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


class DraftSession:
    """A DFlash drafter serving R sequences: `extend` contexts, `propose` one block per row.

    zero_features: feed zeros instead of target features (control drafters are evaluated so).
    Call `refresh` after the drafter's weights change (the decoding engine does before every
    speculative decode).
    """

    def __init__(self, drafter: DFlashDrafter, *, rows: int, max_len: int, zero_features: bool = False):
        self.drafter = drafter
        self.config = cfg = drafter.config
        self.zero_features = zero_features
        w = drafter.fc.weight
        self.device, self.dtype = dev, dtype = w.device, w.dtype
        self.rows, self.max_len = rows, max_len
        L, Hq, Hkv, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.kv_ctx = torch.zeros((2, L, rows, Hkv, max_len, D), device=dev, dtype=dtype)
        self.k_ctx, self.v_ctx = self.kv_ctx[0], self.kv_ctx[1]  # [L,R,Hkv,S,D] views
        self._all_rows = torch.arange(rows, device=dev)
        self._positions = torch.arange(max_len, device=dev)
        cos, sin = rope_cos_sin(self._positions[None], D, cfg.rope_theta)  # fp32 [1,S,D], as per call
        self._cos, self._sin = rope_pairs(cos[0].to(dtype), sin[0].to(dtype))  # [S,2,D]: (rotated, identity)
        self._qkv_kind = torch.tensor([0] * (Hq + Hkv) + [1] * Hkv, device=dev)  # heads of [q, k, v]
        self._kv_kind = torch.tensor([0, 1], device=dev)  # [k, v]
        self._mask_id = torch.full((1, 1), cfg.mask_token_id, dtype=torch.long, device=dev)
        self._zero, self._neg_inf = (torch.full((), v, dtype=dtype, device=dev) for v in (0.0, float("-inf")))
        self._kv_weight = torch.empty(2 * L * Hkv * D, cfg.hidden_size, device=dev, dtype=dtype)
        self._qk_norm_weight = torch.empty(L, Hq + Hkv, D, device=dev, dtype=torch.float32)  # per head
        self.refresh()
        # q/k/v and gate/up in one matmul each where the drafter is frozen (`fused_linear`: its parameters then
        # share one storage per layer); a drafter being trained keeps its own and runs its linears one by one
        with torch.no_grad():
            self._fused = [(fused_linear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                            fused_linear([layer.mlp.gate_proj, layer.mlp.up_proj])) for layer in drafter.layers]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the drafter's current weights into the stacked copies the session reads: k_proj of
        every layer, then v_proj of every layer [2·L·Hkv·D, H] (`extend`), and every layer's q_norm
        and k_norm weights per head [L, Hq+Hkv, D] fp32 (in place: a captured round keeps its
        addresses)."""
        cfg = self.config
        layers = [layer.self_attn for layer in self.drafter.layers]
        torch.cat([a.k_proj.weight for a in layers] + [a.v_proj.weight for a in layers], out=self._kv_weight)
        self._qk_norm_weight.copy_(torch.stack([
            torch.cat([a.q_norm.weight.expand(cfg.num_attention_heads, -1),
                       a.k_norm.weight.expand(cfg.num_key_value_heads, -1)]) for a in layers]))

    @torch.no_grad()
    def extend(self, features: torch.Tensor, start: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Write the target features [m,n,k·H] of positions start[i] … start[i]+n−1 into rows
        `rows` [m] (default all R rows, m = R). Positions past a row's valid context are allowed
        (they stay invisible until a later write makes them valid)."""
        rows = self._all_rows if rows is None else rows
        m, n, _ = features.shape
        cfg, d = self.config, self.drafter
        L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        if self.zero_features:
            features = torch.zeros_like(features)
        context = _rms(d.hidden_norm, d.fc(features.to(self.dtype)))  # [m,n,H]
        kv = F.linear(context, self._kv_weight).view(m, n, 2, L, Hkv, D)  # every layer's k_proj, v_proj
        # every layer's k_norm at once (drafter/layers.py RMSNorm: fp32 statistics and weight, one rounding)
        head_rms_norm_(kv[:, :, 0], self._qk_norm_weight[:, cfg.num_attention_heads:][:, :1], cfg.rms_norm_eps)
        pos = start[:, None] + self._positions[:n][None]  # [m,n]
        at = (pos[:, :, None], self._kv_kind)
        cos, sin = self._cos[at][:, :, :, None, None], self._sin[at][:, :, :, None, None]  # [m,n,2,1,1,D]
        self.kv_ctx[:, :, rows[:, None], :, pos] = rotate_half_rope(kv, cos, sin)  # k rotated, v unchanged

    @torch.no_grad()
    def propose(self, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, span: int,
                block_size: int | None = None, greedy: bool = False) -> torch.Tensor:
        """Logits fp32 [R,B−1,V] of slots 1 … B−1 of every row's block [anchor, MASK × (B−1)]: the
        B−1 drafts of a round (a draft length k runs the block of B = k+1, decoding/engine.py).
        greedy: the caller only takes the argmax, so a drafter whose logits function is the plain LM
        head (no logit scale or softcap) returns them in its dtype (their fp32 copy has the same
        argmax; the conversion of [R,B−1,V] is skipped); else fp32 as without it.

        anchor_tokens / anchor_pos: [R] long; row r's context is its slots 0 … anchor_pos[r]−1.
        span: context slots read (≥ max(anchor_pos), ≤ max_len − B; a host-side bound, no sync).
        block_size: B at inference (2 … trained B; default the trained B). Writes the block's keys and
        values into slots anchor_pos … anchor_pos+B−1 (module docstring). Raises ValueError for a
        block size outside 2 … trained B or a span past the context length.
        """
        cfg = self.config
        B = cfg.inference_block_size(block_size)
        d, R = self.drafter, anchor_tokens.shape[0]
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        G = Hq // Hkv
        K = span + B  # keys: context slots and the block's own
        if K > self.max_len:
            raise ValueError(f"span {span} + block {B} exceeds the context length {self.max_len}")
        ids = torch.cat([anchor_tokens[:, None], self._mask_id.expand(R, B - 1)], dim=1)  # [R,B]
        x = d.embed_block(ids).to(self.dtype)  # [R,B,H]
        pos = anchor_pos[:, None] + self._positions[:B][None]  # [R,B]
        at = (pos[:, :, None], self._qkv_kind)
        cos, sin = self._cos[at], self._sin[at]  # [R,B,Hh,D]
        key_pos = self._positions[:K]
        a = anchor_pos[:, None, None]
        seen = key_pos < a + B  # [R,1,K]: the context (p < anchor) and the block's own slots
        rows = self._all_rows[:R]
        masks: dict[int | None, torch.Tensor] = {}
        for i, layer in enumerate(d.layers):
            W = d.window_of(i)
            if W not in masks:
                if W is None:  # every query row sees the same keys: [R,1,1,K], broadcast
                    masks[W] = torch.where(seen, self._zero, self._neg_inf)[:, None]
                else:  # context slots within the window of each block slot: [R,1,G·B,K], row g·B + k
                    vis = seen & (((pos[:, :, None] - key_pos) < W) | (key_pos >= a))  # [R,B,K]
                    masks[W] = torch.where(vis, self._zero, self._neg_inf)[:, None].repeat(1, 1, G, 1).view(
                        R, 1, G * B, K)
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, gate_up_w = self._fused[i]
            h = _rms(layer.input_layernorm, x)
            qkv = F.linear(h, *qkv_w) if qkv_w is not None else torch.cat([attn.q_proj(h), attn.k_proj(h),
                                                                           attn.v_proj(h)], dim=-1)
            qkv = qkv.view(R, B, Hq + 2 * Hkv, D)
            head_rms_norm_(qkv[:, :, :Hq + Hkv], self._qk_norm_weight[i], cfg.rms_norm_eps)  # q_norm, k_norm
            y = rotate_half_rope(qkv, cos, sin, out=head_major(R, B, Hq + 2 * Hkv, D, qkv))  # [R,B,Hh,D]
            self.kv_ctx[:, i][:, rows[:, None], :, pos] = y[:, :, Hq:].view(R, B, 2, Hkv, D)  # the block's k, v
            qg = y[:, :, :Hq].transpose(1, 2).reshape(R, Hkv, G * B, D)  # head h = kv·G + g
            out = F.scaled_dot_product_attention(qg, self.k_ctx[i][:R, :, :K], self.v_ctx[i][:R, :, :K],
                                                 attn_mask=masks[W])  # [R,Hkv,G·B,D]
            out = out.reshape(R, Hq, B, D).transpose(1, 2).reshape(R, B, -1)
            x = x + attn.o_proj(out)
            h = _rms(layer.post_attention_layernorm, x)
            if gate_up_w is None:
                x = x + mlp(h)
            else:
                gate, up = F.linear(h, *gate_up_w).chunk(2, dim=-1)
                x = x + mlp.down_proj(F.silu(gate) * up)  # DrafterMLP
        # slot 0 (the anchor) predicts nothing; normed after the slice, so the LM head gets a contiguous [R,B−1,H]
        # (a strided view makes it a batched GEMM of B−1 rows each: 10× slower at 64 rows, H100 profile 2026-12-07)
        hidden = _rms(d.norm, x[:, 1:]).contiguous()  # [R,B−1,H] (no copy: the norm writes a new tensor)
        return d.logits(hidden, fp32=not greedy)  # [R,B−1,V], the target's logits function
