"""Derive a drafter config from the target's HF config and tokenizer (FIELD_NOTES §1).

Widths, heads, head_dim, RoPE base, norm epsilon and vocabulary are copied from the target. The
mask token is an existing embedding row: the first row no tokenizer entry uses, or, when every
row is a real token (SmolLM2: 49152 tokens = 49152 rows), a special token that the chat template
never emits and that is not bos/eos/pad/unk. The vocabulary is never resized.
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.drafter.config import DrafterConfig, resolve_layer_types
from dflash_trainer.target_model.layers import default_target_layer_ids


def rope_theta_of(hf_config: Any) -> float:
    """RoPE base of an HF config (transformers 5 keeps it in `rope_parameters`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


def choose_mask_token(tokenizer: Any, vocab_rows: int, chat_template: str | None = None) -> tuple[int, str]:
    """Pick the mask token id and say why.

    Returns (id, reason). Prefers the first embedding row beyond the tokenizer (`len(tokenizer)`
    < vocab_rows). Otherwise the first added special token that the chat template never mentions
    and that is none of bos/eos/pad/unk. Raises ValueError naming `mask_token_id` if none exists.
    """
    n_tok = len(tokenizer)
    if n_tok < vocab_rows:
        return n_tok, f"first unused embedding row ({n_tok} tokenizer entries, {vocab_rows} rows)"
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    reserved = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for tid in sorted(added):
        content = str(added[tid])
        content = getattr(added[tid], "content", content)
        if tid in reserved or tid >= vocab_rows or not content or content in template:
            continue
        return int(tid), f"special token {content!r} (id {tid}): every row is a real token and the chat template never emits it"
    raise ValueError("mask_token_id: the target has no unused embedding row and no spare special token; pass --mask-token-id ID")


def drafter_config_from_target(hf_config: Any, tokenizer: Any, *, num_layers: int = 5, block_size: int = 16,
                               layer_types: str | list[str] = "full", sliding_window: int | None = None,
                               target_layer_ids: list[int] | None = None, num_target_features: int = 5,
                               mask_token_id: int | None = None, chat_template: str | None = None) -> tuple[DrafterConfig, str]:
    """Build a DrafterConfig whose widths match the target.

    Returns (config, mask_reason). Raises ValueError (pydantic validation) for ids out of range,
    unsorted or duplicated ids, a window without sliding layers' size, indivisible heads, a mask
    id outside the vocabulary, or a mask id that the tokenizer uses for an ordinary token.
    """
    L = int(hf_config.num_hidden_layers)
    heads = int(hf_config.num_attention_heads)
    hidden = int(hf_config.hidden_size)
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    vocab = int(hf_config.vocab_size)
    ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(L, num_target_features)
    if mask_token_id is None:
        mask_token_id, reason = choose_mask_token(tokenizer, vocab, chat_template)
    else:
        reason = "given explicitly"
        special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        if tokenizer is not None and mask_token_id < len(tokenizer) and mask_token_id not in special:
            raise ValueError(f"mask_token_id={mask_token_id} is an ordinary token of the tokenizer "
                             f"({tokenizer.convert_ids_to_tokens(mask_token_id)!r}); use an unused row or a spare special token")
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=int(hf_config.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(hf_config),
        vocab_size=vocab,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 32768)),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=ids,
        num_target_layers=L,
        layer_types=resolve_layer_types(layer_types, num_layers),
        sliding_window=sliding_window,
    )
    return cfg, reason
