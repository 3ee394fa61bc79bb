"""Qwen3-style building blocks of the DFlash drafter: RMSNorm, RoPE, attention, MLP, decoder layer.

Shapes: R = rows, T = context (packed target) positions, Q = N·B block queries, K = T + Q keys,
H = hidden size, Hq / Hkv = query / key-value heads, D = head_dim.

Parameter names follow HF Qwen3 (`self_attn.q_proj`, `self_attn.k_norm`, `input_layernorm`,
`post_attention_layernorm`, `mlp.gate_proj` ...) so that export is a plain key map.

KV injection (DFlash): every layer attends from the block queries over the keys
`[k_proj(C); k_proj(h)]` where C [R,T,H] are the fused target features (already normalized by the
drafter's `hidden_norm`, identical for every layer) and h [R,Q,H] are the layer's
input-layernormed block hidden states. `input_layernorm` is applied to the block stream only;
C enters `k_proj`/`v_proj` as it is. `k_norm` is applied to both key parts, RoPE to both with
their own absolute positions.

Two attention backends, chosen by the mask's type: a dense boolean mask [R,Q,K] or [R,1,Q,K]
(True = attend) runs SDPA; a flex `BlockMask` over (Q, K) runs flex attention (compiled once per
process on CUDA).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_trainer.drafter.config import DrafterConfig

Mask = torch.Tensor | BlockMask

@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process, at first use (one shared compiled callable)."""
    return torch.compile(flex_attention, dynamic=False)


# Flex attention tiles measured on an H200 (sm90) for head_dim 128 in bf16, on the reference step's own
# masks (benchmarks/flex_options.py: torch's max-autotune choices; benchmarks/reports/
# 2026-12-03-clip-adamw-flex-tiles.md): in the reference step, flex forward + backward 11.9 → 10.5 ms.
SM90_D128_FLEX_OPTIONS = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4,
                          "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                          "bwd_num_stages": 3, "bwd_num_warps": 4}


def tuned_flex_options(head_dim: int, device: torch.device) -> dict | None:
    """Flex kernel options measured for this GPU and head_dim (bf16 inputs), or None for torch's defaults.

    Only sm90 (H100/H200) at head_dim 128 has a measured set (SM90_D128_FLEX_OPTIONS); elsewhere
    torch's own heuristics stay in charge. A host query of the device's capability, no sync."""
    if device.type == "cuda" and head_dim == 128 and torch.cuda.get_device_capability(device) == (9, 0):
        return dict(SM90_D128_FLEX_OPTIONS)
    return None


def _flex_fn(compiled: bool):
    """flex_attention, or its compiled version when `compiled`."""
    return _compiled_flex() if compiled else flex_attention


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32, returned in the input's dtype (Qwen3 semantics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R,L,D] fp32 for absolute positions [R,L] (rotate-half layout: frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids.float()[..., None] * inv_freq  # [R,L,D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [R,L,D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R,h,L,D] rotated by cos/sin [R,L,D] (rotate-half convention), in x's dtype."""
    cos = cos[:, None].to(x.dtype)
    sin = sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DrafterAttention(nn.Module):
    """Attention from block queries over [context keys (T); block keys (Q)] with GQA."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        # flex kernel options for bf16 inputs (None: torch's defaults); set by DFlashDrafter.compile_layers
        self.flex_options: dict | None = None

    def split_heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[R,L,n·D] projections → [R,n,L,D] heads (also used by the evaluation's cached drafting)."""
        r, length, _ = x.shape
        return x.view(r, length, n, self.head_dim).transpose(1, 2)  # [R,n,L,D]

    def forward(self, h: torch.Tensor, context: torch.Tensor, q_rope: tuple[torch.Tensor, torch.Tensor],
                k_rope: tuple[torch.Tensor, torch.Tensor], mask: Mask, compile_flex: bool) -> torch.Tensor:
        """h [R,Q,H] normed block states, context [R,T,H] fused features -> [R,Q,H].

        q_rope: cos/sin [R,Q,D] at block positions; k_rope: cos/sin [R,T+Q,D] at context then block
        positions. mask: dense bool [R,Q,T+Q] or [R,1,Q,T+Q] (True = attend) or BlockMask over (Q, T+Q).
        """
        r, nq, _ = h.shape
        q = self.q_norm(self.split_heads(self.q_proj(h), self.num_heads))  # [R,Hq,Q,D]
        # Context and block parts are projected separately (no [R,T+Q,H] copy per layer; autograd
        # keeps one shared C for all layers) and joined after the projection.
        k = torch.cat([self.k_proj(context), self.k_proj(h)], dim=1)  # [R,T+Q,Hkv·D]
        v = torch.cat([self.v_proj(context), self.v_proj(h)], dim=1)  # [R,T+Q,Hkv·D]
        k = self.k_norm(self.split_heads(k, self.num_kv_heads))  # [R,Hkv,T+Q,D]
        v = self.split_heads(v, self.num_kv_heads)  # [R,Hkv,T+Q,D]
        q = apply_rope(q, *q_rope)
        k = apply_rope(k, *k_rope)
        # Under autocast the norms keep their input dtype, so q/k/v agree; align them otherwise.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if isinstance(mask, BlockMask):
            # tuned for bf16 training shapes only; below 128 queries torch may pick its decoding kernel
            options = self.flex_options if q.dtype == torch.bfloat16 and q.shape[-2] >= 128 else None
            out = _flex_fn(compile_flex and q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True,
                                                       kernel_options=options)
        else:
            attn_mask = mask[:, None] if mask.dim() == 3 else mask  # [R,Q,K] or [R,1,Q,K] -> [R,1,Q,K]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(r, nq, self.num_heads * self.head_dim)  # [R,Q,Hq·D]
        return self.o_proj(out)


class DrafterMLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, m = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=False)
        self.up_proj = nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the context C is read (through k_proj/v_proj) but not updated."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, q_rope: tuple[torch.Tensor, torch.Tensor],
                k_rope: tuple[torch.Tensor, torch.Tensor], mask: Mask, compile_flex: bool) -> torch.Tensor:
        """x [R,Q,H] block residual stream, context [R,T,H] -> [R,Q,H]."""
        x = x + self.self_attn(self.input_layernorm(x), context, q_rope, k_rope, mask, compile_flex)
        return x + self.mlp(self.post_attention_layernorm(x))
