"""The DFlash drafter (arXiv 2602.06036 §4): fused target features injected as keys/values into a
few Qwen3-style layers that denoise a block [anchor, MASK × (B−1)] in one pass.

Shapes: R = rows, T = packed context positions, N = anchors per row, B = block size, Q = N·B block
queries, H = hidden size, k = number of target layers (features are k·H wide), V = vocabulary.

Flow of `forward`:
  C = hidden_norm(fc(features))                 [R,T,k·H] -> [R,T,H]  (once, shared by all layers)
  X = embedding_scale · E[block_input_ids]     [R,Q,H]               (target's frozen embedding)
  per layer i: X = layer_i(X, C, mask for the layer's window)
  return norm(X)                                [R,Q,H]               (logits: `logits`, the target's LM head)

`embed_block` and `logits` are the target's own embedding and logits functions (target_model/shared_head.py:
Gemma's √H, Granite's and Falcon-H1's multipliers, soft-capping), used by training, validation and eval.

The target's embedding and LM head are held outside the module tree: they are neither parameters
nor state_dict entries of the drafter, are never saved, and are frozen here (requires_grad False).
Saved weights are exactly `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.layers import DrafterDecoderLayer, Mask, RMSNorm, rope_cos_sin, tuned_flex_options
from dflash_trainer.target_model.shared_head import embed_block, head_logits

CheckpointPolicy = list[int] | Literal["all"] | None


def _resolve_checkpoint_layers(policy: CheckpointPolicy, num_layers: int) -> frozenset[int]:
    if policy is None:
        return frozenset()
    if policy == "all":
        return frozenset(range(num_layers))
    if isinstance(policy, str):
        raise ValueError(f"checkpoint_layers={policy!r}: use None, 'all' or a list of layer indices")
    bad = [i for i in policy if not 0 <= int(i) < num_layers]
    if bad:
        raise ValueError(f"checkpoint_layers={list(policy)}: indices {bad} outside [0, {num_layers - 1}]")
    return frozenset(int(i) for i in policy)


class DFlashDrafter(nn.Module):
    """DFlash drafter over a frozen target's embedding and LM head.

    config: the drafter's architecture. embed_tokens [V,H] / lm_head [V,H]: the target's modules
    (shared, not copied, frozen). checkpoint_layers: activation checkpointing per layer — None,
    "all" or a list of layer indices. compile_flex: compile flex attention on CUDA (False = eager
    flex, a slow reference path).
    """

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear, *,
                 checkpoint_layers: CheckpointPolicy = None, compile_flex: bool = True):
        super().__init__()
        h = config.hidden_size
        if embed_tokens.weight.shape != (config.vocab_size, h) or lm_head.weight.shape != (config.vocab_size, h):
            raise ValueError(f"embed_tokens {tuple(embed_tokens.weight.shape)} / lm_head {tuple(lm_head.weight.shape)} "
                             f"must both be (vocab_size={config.vocab_size}, hidden_size={h}); check the drafter config")
        self.config = config
        self.fc = nn.Linear(config.num_aux_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        # A plain tuple is not registered by nn.Module: the target's modules stay out of
        # parameters(), state_dict() and .to(); they live wherever the target put them.
        self._target_modules = (embed_tokens, lm_head)
        self.checkpoint_layers = _resolve_checkpoint_layers(checkpoint_layers, config.num_hidden_layers)
        self.compile_flex = compile_flex
        self.reset_parameters()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._target_modules[1]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's LM head weight [V,H] (frozen)."""
        return self._target_modules[1].weight

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        """The block input the target's first layer would see for `ids`: embedding_scale · E[ids]
        ([..] int64 → [..,H] in the embedding's dtype). Read from the weight, so a target module that
        scales by itself (Gemma) is not applied twice."""
        return embed_block(ids, self.embed_tokens.weight, self.config.embedding_scale)

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """The target's logits function of final-normed hidden states: [..,H] → fp32 [..,V]
        (LM head, then the config's logit_scale and logit_softcap). fp32=False: see head_logits
        (the drafter's dtype for a plain head, for argmax-only callers)."""
        return head_logits(hidden, self.lm_head_weight, self.config.logit_scale, self.config.logit_softcap, fp32)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Linears ~ N(0, 0.02), norms = 1 (uses the global torch RNG)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.02)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def window_of(self, i: int) -> int | None:
        """Sliding window of drafter layer i, None for a full-attention layer."""
        return self.config.sliding_window if self.config.layer_types[i] == "sliding_attention" else None

    def as_param_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """`x` in the weights' dtype unless autocast is on (then unchanged)."""
        # Without autocast the matmuls need the inputs in the weights' dtype (e.g. a bf16 target
        # feeding an fp32 drafter); under autocast they are cast per op, so leave them alone.
        if torch.is_autocast_enabled(x.device.type):
            return x
        return x.to(self.fc.weight.dtype)

    def forward(self, features: torch.Tensor, context_position_ids: torch.Tensor, block_input_ids: torch.Tensor,
                block_position_ids: torch.Tensor, masks: dict[int | None, Mask]) -> torch.Tensor:
        """features [R,T,k·H], context_position_ids [R,T] int, block_input_ids / block_position_ids
        [R,Q] int64, masks {window (None = full): dense bool [R,Q,T+Q] or [R,1,Q,T+Q], or BlockMask over (Q, T+Q)}
        -> final-normed hidden [R,Q,H].
        """
        cfg = self.config
        context = self.hidden_norm(self.fc(self.as_param_dtype(features)))  # [R,T,H]
        x = self.as_param_dtype(self.embed_block(block_input_ids))  # [R,Q,H]
        q_rope = rope_cos_sin(block_position_ids, cfg.head_dim, cfg.rope_theta)  # [R,Q,D] ×2
        key_pos = torch.cat([context_position_ids.to(block_position_ids.dtype), block_position_ids], dim=1)  # [R,T+Q]
        k_rope = rope_cos_sin(key_pos, cfg.head_dim, cfg.rope_theta)  # [R,T+Q,D] ×2
        for i, layer in enumerate(self.layers):
            window = self.window_of(i)
            if window not in masks:
                raise ValueError(f"masks: no mask for window {window} (layer {i} is {cfg.layer_types[i]}); "
                                 f"build masks for config.attention_windows()={cfg.attention_windows()}")
            mask = masks[window]
            if i in self.checkpoint_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, context, q_rope, k_rope, mask, self.compile_flex, use_reentrant=False)
            else:
                x = layer(x, context, q_rope, k_rope, mask, self.compile_flex)
        return self.norm(x)

    def compile_layers(self) -> None:
        """Compile each decoder layer in place (fixed shapes): fuses norms, RoPE, SiLU and residuals
        around the matmuls and compiles flex attention inside the layer, with the flex kernel options
        measured for this GPU and head_dim when there are some (layers.tuned_flex_options). The two
        norms outside the layers (`hidden_norm` of the context, the final `norm`) are compiled too:
        eager, each is a chain of fp32 passes over [R,T,H] / [R,Q,H] forward and backward. Call
        after `.to(device)`."""
        options = tuned_flex_options(self.config.head_dim, self.fc.weight.device)
        for layer in self.layers:
            layer.self_attn.flex_options = options
            layer.compile(dynamic=False)
        self.hidden_norm.compile(dynamic=False)
        self.norm.compile(dynamic=False)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds: `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`
        (detached, on their current device)."""
        sd = {k: v.detach() for k, v in self.state_dict().items()}
        assert all(k.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for k in sd), sorted(sd)
        return sd

    def load_trainable_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights saved by `trainable_state_dict` (strict: same keys and shapes)."""
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint keys differ: missing {missing[:8]}, unexpected {unexpected[:8]}; "
                             "was it saved for a different drafter config?")
        self.load_state_dict(state_dict, strict=True)
