"""The drafter at inference for many sequences at once: static per-row context K/V, one block per row.

Shapes: R = rows, S = context slots per row (`max_len`), B = block size, k·H = feature width,
Hq / Hkv = query / key-value heads, D = head_dim, V = vocabulary.

Same semantics as `draft.DraftSession` (one sequence) and as training (FIELD_NOTES §1–2): the block
anchored at position a_r is `[anchor token, MASK × (B−1)]` at positions a_r … a_r+B−1; it sees
the target features of every context position p < a_r (sliding layers also (a_r+k) − p < W) and
its whole own block. Context keys/values (`k_norm(k_proj(C))` rotated at p, `v_proj(C)`, with
C = hidden_norm(fc(features))) depend only on the features and p, so they are computed once when
written and reused by every later round. Like the target's batched cache, a write of n positions
at start_r fills slots start_r … start_r+n−1; slots at or past a row's anchor are never visible,
so features of rejected drafts need no removal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trainer.drafter.layers import apply_rope, rope_cos_sin
from dflash_trainer.drafter.model import DFlashDrafter


class BatchedDraftSession:
    """A DFlash drafter serving R sequences: `extend` contexts, `propose` one block per row.

    zero_features: feed zeros instead of target features (control drafters are evaluated so).
    """

    def __init__(self, drafter: DFlashDrafter, *, rows: int, max_len: int, zero_features: bool = False):
        self.drafter = drafter
        self.config = cfg = drafter.config
        self.zero_features = zero_features
        w = drafter.fc.weight
        self.device, self.dtype = w.device, w.dtype
        self.rows, self.max_len = rows, max_len
        shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_ctx = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_ctx = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self._all_rows = torch.arange(rows, device=self.device)

    @torch.no_grad()
    def extend(self, features: torch.Tensor, start: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Write the target features [m,n,k·H] of positions start[i] … start[i]+n−1 into rows
        `rows` [m] (default all R rows, m = R). Positions past a row's valid context are allowed
        (they stay invisible until a later write makes them valid)."""
        rows = self._all_rows if rows is None else rows
        m, n, _ = features.shape
        d = self.drafter
        if self.zero_features:
            features = torch.zeros_like(features)
        context = d.hidden_norm(d.fc(features.to(self.dtype)))  # [m,n,H]
        pos = start[:, None] + torch.arange(n, device=self.device)[None]  # [m,n]
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta)  # [m,n,D]
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            k = apply_rope(attn.k_norm(attn.split_heads(attn.k_proj(context), attn.num_kv_heads)), cos, sin)  # [m,Hkv,n,D]
            v = attn.split_heads(attn.v_proj(context), attn.num_kv_heads)
            self.k_ctx[i][rows[:, None], :, pos] = k.transpose(1, 2).to(self.dtype)
            self.v_ctx[i][rows[:, None], :, pos] = v.transpose(1, 2).to(self.dtype)

    @torch.no_grad()
    def propose(self, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, span: int,
                block_size: int | None = None) -> torch.Tensor:
        """Logits fp32 [R,B−1,V] of slots 1 … B−1 of every row's block.

        anchor_tokens / anchor_pos: [R] long; row r's context is its slots 0 … anchor_pos[r]−1.
        span: context slots read (≥ max(anchor_pos), ≤ max_len; a host-side bound, no sync).
        block_size: B at inference (2 … trained B). Raises ValueError otherwise.
        """
        cfg = self.config
        B = cfg.inference_block_size(block_size)
        d, R = self.drafter, anchor_tokens.shape[0]
        ids = torch.full((R, B), cfg.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = anchor_tokens
        x = d.embed(ids).to(self.dtype)  # [R,B,H]
        pos = anchor_pos[:, None] + torch.arange(B, device=self.device)[None]  # [R,B]
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)  # [R,B,D]
        ctx_pos = torch.arange(span, device=self.device)
        visible = ctx_pos[None, None] < anchor_pos[:, None, None]  # [R,1,span]: p < anchor
        G = cfg.num_attention_heads // cfg.num_key_value_heads
        masks: dict[int | None, torch.Tensor] = {}
        for i, layer in enumerate(d.layers):
            W = d.window_of(i)
            if W not in masks:
                ctx = visible.expand(R, B, span)
                if W is not None:
                    ctx = ctx & ((pos[:, :, None] - ctx_pos[None, None]) < W)
                full = torch.cat([ctx, torch.ones(R, B, B, dtype=torch.bool, device=self.device)], dim=2)  # [R,B,span+B]
                masks[W] = full[:, None].repeat(1, 1, G, 1).view(R, 1, G * B, span + B)
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(attn.q_norm(attn.split_heads(attn.q_proj(h), attn.num_heads)), cos, sin)  # [R,Hq,B,D]
            kb = apply_rope(attn.k_norm(attn.split_heads(attn.k_proj(h), attn.num_kv_heads)), cos, sin)  # [R,Hkv,B,D]
            vb = attn.split_heads(attn.v_proj(h), attn.num_kv_heads)
            k = torch.cat([self.k_ctx[i][:, :, :span], kb.to(self.dtype)], dim=2)  # [R,Hkv,span+B,D]
            v = torch.cat([self.v_ctx[i][:, :, :span], vb.to(self.dtype)], dim=2)
            qg = q.reshape(R, cfg.num_key_value_heads, G * B, cfg.head_dim).to(v.dtype)  # head h = kv·G + g
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=masks[W])  # [R,Hkv,G·B,D]
            out = out.reshape(R, attn.num_heads, B, cfg.head_dim).transpose(1, 2).reshape(R, B, -1)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = d.norm(x)[:, 1:]  # [R,B−1,H]; slot 0 (the anchor) predicts nothing
        return F.linear(hidden, d.lm_head_weight.to(hidden.dtype)).float()
