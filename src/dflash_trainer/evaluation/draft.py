"""The drafter at inference: one growing context, one block per round, projected context K/V cached.

Shapes: L = committed context positions (one document, positions 0..L−1), B = block size,
H = hidden size, k = target layers (features are k·H wide), Hq / Hkv = query / key-value heads,
D = head_dim, V = vocabulary.

Semantics are those of training (FIELD_NOTES §1–2, `drafter/blocks.py`): a block anchored at
position a is `[token at a, MASK × (B−1)]` at positions a … a+B−1, it sees the target features of
every position p < a (sliding layers also (a+k) − p < W) and its whole own block, and slot k
predicts the token at a+k. At inference the anchor is the last committed token (the target's
bonus token): its own features are not known yet, so the context is exactly the positions before
it and every round calls `propose(anchor_token, anchor_pos=L)`.

Cache: in every drafter layer the context keys and values are `k_norm(k_proj(C))` rotated at the
context positions and `v_proj(C)`, with C = hidden_norm(fc(features)). They depend only on the
features and their positions, never on the block, so they are computed once per position when the
position joins the context (`extend`) and reused by every later round. A round costs the block's
own B queries over L + B keys per layer. The fast path is checked against `DFlashDrafter.forward`
with the dense training mask in tests/unit/test_eval_draft.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trainer.drafter.layers import apply_rope, rope_cos_sin
from dflash_trainer.drafter.model import DFlashDrafter


class DraftSession:
    """A DFlash drafter serving one sequence: `extend` the context, `propose` a block.

    zero_features: feed zeros instead of the target features (a drafter trained with
    `no_target_features`, the paper's control, must be evaluated the same way).
    """

    def __init__(self, drafter: DFlashDrafter, *, zero_features: bool = False):
        self.drafter = drafter
        self.config = drafter.config
        self.zero_features = zero_features
        self.reset()

    def reset(self) -> None:
        """Forget the context (a new sequence starts)."""
        n = self.config.num_hidden_layers
        self._keys: list[torch.Tensor | None] = [None] * n  # per layer [1,Hkv,L,D], normed + rotated
        self._values: list[torch.Tensor | None] = [None] * n  # per layer [1,Hkv,L,D]
        self.length = 0

    @torch.no_grad()
    def extend(self, features: torch.Tensor, start: int) -> None:
        """Append the target features of positions start … start+n−1 to the context.

        features: [n,k·H] or [1,n,k·H]. start must equal the current length (positions are
        contiguous); ValueError otherwise.
        """
        if start != self.length:
            raise ValueError(f"extend(start={start}) but the context holds positions 0..{self.length - 1}; "
                             "positions must be appended in order")
        if features.dim() == 2:
            features = features[None]
        n = features.shape[1]
        if n == 0:
            return
        d = self.drafter
        if self.zero_features:
            features = torch.zeros_like(features)
        context = d.hidden_norm(d.fc(d.as_param_dtype(features)))  # [1,n,H]
        pos = torch.arange(start, start + n, device=context.device)[None]  # [1,n]
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta)  # [1,n,D] ×2
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            k = attn.k_norm(attn.split_heads(attn.k_proj(context), attn.num_kv_heads))  # [1,Hkv,n,D]
            k = apply_rope(k, cos, sin)
            v = attn.split_heads(attn.v_proj(context), attn.num_kv_heads)  # [1,Hkv,n,D]
            prev_k, prev_v = self._keys[i], self._values[i]
            self._keys[i] = k if prev_k is None else torch.cat([prev_k, k], dim=2)
            self._values[i] = v if prev_v is None else torch.cat([prev_v, v], dim=2)
        self.length += n

    @torch.no_grad()
    def propose(self, anchor_token: int, anchor_pos: int, block_size: int | None = None) -> torch.Tensor:
        """Logits of the block's slots 1..B−1 (fp32 [B−1,V]) for the block anchored at `anchor_pos`.

        The context must hold exactly the positions before the anchor (anchor_pos == length).
        block_size: B at inference (default: the trained B; a smaller B is allowed, a larger one
        is not — the drafter never saw those slots). Raises ValueError otherwise.
        """
        cfg = self.config
        B = cfg.inference_block_size(block_size)
        if anchor_pos != self.length:
            raise ValueError(f"anchor at position {anchor_pos} but the context holds {self.length} positions; "
                             "the context must be exactly the positions before the anchor")
        d = self.drafter
        device = d.fc.weight.device
        ids = torch.full((1, B), cfg.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor_token
        x = d.as_param_dtype(d.embed(ids))  # [1,B,H]
        pos = torch.arange(anchor_pos, anchor_pos + B, device=device)[None]  # [1,B]
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)  # [1,B,D] ×2
        L = self.length
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(attn.q_norm(attn.split_heads(attn.q_proj(h), attn.num_heads)), cos, sin)  # [1,Hq,B,D]
            kb = apply_rope(attn.k_norm(attn.split_heads(attn.k_proj(h), attn.num_kv_heads)), cos, sin)  # [1,Hkv,B,D]
            vb = attn.split_heads(attn.v_proj(h), attn.num_kv_heads)  # [1,Hkv,B,D]
            if L:
                k = torch.cat([self._keys[i], kb], dim=2)  # [1,Hkv,L+B,D]
                v = torch.cat([self._values[i], vb], dim=2)
            else:
                k, v = kb, vb
            q, k = q.to(v.dtype), k.to(v.dtype)
            mask = self._window_mask(i, anchor_pos, B, device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [1,Hq,B,D]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(1, B, attn.num_heads * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = d.norm(x)[0, 1:]  # [B−1,H]; slot 0 (the anchor) predicts nothing
        return F.linear(hidden, d.lm_head_weight.to(hidden.dtype)).float()  # [B−1,V]

    def _window_mask(self, layer: int, anchor_pos: int, B: int, device: torch.device) -> torch.Tensor | None:
        """None (everything visible) for full-attention layers; for a sliding layer with window W,
        bool [1,1,B,L+B]: slot k sees context p iff (anchor+k) − p < W, and its whole block."""
        window = self.drafter.window_of(layer)
        if window is None:
            return None
        L = self.length
        p = torch.arange(L, device=device)  # [L]
        q_pos = anchor_pos + torch.arange(B, device=device)[:, None]  # [B,1]
        ctx = (q_pos - p) < window  # [B,L]
        blk = torch.ones(B, B, dtype=torch.bool, device=device)
        return torch.cat([ctx, blk], dim=1)[None, None]  # [1,1,B,L+B]
