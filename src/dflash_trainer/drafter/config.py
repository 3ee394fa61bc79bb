"""The drafter's architecture config (DFlash, arXiv 2602.06036 §4).

The drafter copies the target's width (hidden size, heads, KV heads, head_dim, MLP size, vocab,
RoPE) and adds the DFlash fields: number of layers, block size, mask token, target_layer_ids and
per-layer attention types (full or sliding window). Three fields copy what the target does around
its embedding and LM head (embedding_scale, logit_scale, logit_softcap: target_model/shared_head.py), so
the drafter's block input and logits are the target's own functions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dflash_trainer.config.sections import check_layer_ids

LayerType = Literal["full_attention", "sliding_attention"]


def default_gamma(block_size: int) -> float:
    """Loss decay γ for a block size: 7 / 5 / 4 for B = 16 / 10 / 8 (paper), else B/2.3 rounded.

    Returns a float > 0. Source: DFlash paper A.1 (γ per block size).
    """
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    return table.get(block_size, max(1.0, round(block_size / 2.3, 1)))


class DrafterConfig(BaseModel):
    """Architecture of a DFlash drafter. All widths are copied from the target.

    Field names follow HF Qwen3 naming so that export is a plain key map.
    """

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(..., gt=0, description="Model width H (= target hidden size).")
    intermediate_size: int = Field(..., gt=0, description="MLP width (= target's).")
    num_hidden_layers: int = Field(..., gt=0, description="Drafter decoder layers (the shape's default lives in the config's drafter section).")
    num_attention_heads: int = Field(..., gt=0, description="Query heads (= target's).")
    num_key_value_heads: int = Field(..., gt=0, description="KV heads (= target's); divides num_attention_heads.")
    head_dim: int = Field(..., gt=0, description="Per-head width (= target's).")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon (= target's).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (= target's).")
    vocab_size: int = Field(..., gt=0, description="Rows of the target's embedding / LM head.")
    max_position_embeddings: int = Field(32768, gt=0, description="Longest position id supported.")
    block_size: int = Field(..., ge=2, description="B: tokens per draft block (anchor + B-1 masks).")
    mask_token_id: int = Field(..., ge=0, description="Embedding row used for the mask slots; never resized.")
    target_layer_ids: list[int] = Field(..., min_length=1, description="Target layers whose outputs are the aux hidden states (ℓ = output of decoder layer ℓ).")
    num_target_layers: int = Field(..., gt=0, description="Number of decoder layers L in the target.")
    layer_types: list[LayerType] = Field(default_factory=list, description="Per drafter layer: full_attention | sliding_attention (empty = all full).")
    sliding_window: int | None = Field(None, gt=0, description="W for sliding_attention layers (keys within W-1 positions behind the query).")
    # The target's own embedding and logits functions (target_model/shared_head.py); init-config copies them.
    embedding_scale: float = Field(1.0, gt=0, allow_inf_nan=False, description="Factor on the target's embedding rows of the block input, as the target applies it before its first layer (Gemma 2/3: sqrt(H); Granite, Falcon-H1: embedding_multiplier; 1 elsewhere).")
    logit_scale: float = Field(1.0, gt=0, allow_inf_nan=False, description="Factor on the target LM head's logits, as the target applies it (Granite: 1/logits_scaling; Falcon-H1: lm_head_multiplier; 1 elsewhere).")
    logit_softcap: float | None = Field(None, gt=0, allow_inf_nan=False, description="c of the target's final soft-cap c*tanh(z/c), after logit_scale (Gemma 2/3: final_logit_softcapping); None = none.")

    @model_validator(mode="after")
    def _check(self) -> "DrafterConfig":
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers={self.num_hidden_layers}; give one per layer")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_window: required when layer_types contains sliding_attention; set e.g. sliding_window=2048")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads={self.num_attention_heads}")
        check_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary ({self.vocab_size} rows); pick an existing row")
        return self

    @property
    def num_aux_layers(self) -> int:
        """k: number of target layers concatenated into the context features."""
        return len(self.target_layer_ids)

    @property
    def gamma(self) -> float:
        """Default loss decay γ for this block size."""
        return default_gamma(self.block_size)

    def inference_block_size(self, block_size: int | None = None) -> int:
        """B used at inference: `block_size` (None = the trained B). A drafter trained at B works at
        any smaller B ≥ 2, never a larger one (it never saw those slots); ValueError otherwise."""
        B = block_size or self.block_size
        if not 2 <= B <= self.block_size:
            raise ValueError(f"block_size={B}: use 2..{self.block_size} (the drafter was trained at B={self.block_size})")
        return B

    def attention_windows(self) -> list[int | None]:
        """Distinct windows used by the layers (None = full attention), sorted None first."""
        ws = {None if t == "full_attention" else self.sliding_window for t in self.layer_types}
        return sorted(ws, key=lambda w: -1 if w is None else w)

