"""`dflash-train init-config`: a drafter config derived from the target, validated up front.

Reads only the target's config and tokenizer (no weights): widths, heads, head_dim, RoPE base,
norm epsilon and vocabulary come from the target; target_layer_ids follow the DFlash rule
(FIELD_NOTES §1); the mask token is an existing embedding row that no real token uses or, when
every row is a real token, a special token the chat template never emits. The vocabulary is never
resized.

The written JSON holds the DrafterConfig fields plus a `dflash` block (target, mask token and the
reason for it); `train --drafter-config FILE` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_trainer.drafter.config import DrafterConfig, resolve_layer_types
from dflash_trainer.drafter.from_target import drafter_config_from_target
from dflash_trainer.interop.export import mask_token_text
from dflash_trainer.target_model.layers import default_target_layer_ids

DEFAULT_SLIDING_WINDOW = 2048


def check_target_layer_ids(ids: list[int], num_layers: int) -> None:
    """Raise ValueError naming --target-layer-ids for out-of-range, duplicated or unsorted ids."""
    if not ids:
        raise ValueError("--target-layer-ids: empty; give at least one layer id")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--target-layer-ids {ids}: ids {bad} are out of range; the target has {num_layers} decoder "
                         f"layers, so ids lie in [0, {num_layers - 1}] (id ℓ = output of decoder layer ℓ)")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"--target-layer-ids {ids}: ids {dup} are duplicated; each target layer feeds the drafter once")
    if ids != sorted(ids):
        raise ValueError(f"--target-layer-ids {ids}: ids must be in ascending order (the order is baked into the "
                         f"drafter's fc weights); use {sorted(ids)}")


def check_mask_token_id(mask_id: int, tokenizer: Any, vocab_rows: int, chat_template: str | None) -> None:
    """Raise ValueError naming --mask-token-id when the id is not a safe mask row.

    Safe: an embedding row beyond the tokenizer, or a special token that is none of bos/eos/pad/unk
    and that the chat template never emits. Rejected: ids outside the embedding (the vocabulary is
    never resized) and ids the tokenizer uses for a real token.
    """
    if not 0 <= mask_id < vocab_rows:
        raise ValueError(f"--mask-token-id {mask_id}: outside the target's embedding ({vocab_rows} rows); the "
                         "vocabulary is never resized, pick an existing row")
    if tokenizer is None or mask_id >= len(tokenizer):
        return
    text = mask_token_text(tokenizer, mask_id)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if mask_id not in added:
        raise ValueError(f"--mask-token-id {mask_id}: the tokenizer uses it for the real token {text!r}; use an "
                         f"unused row (≥ {len(tokenizer)}) or a spare special token")
    roles = {a: getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    for role, tid in roles.items():
        if tid == mask_id:
            raise ValueError(f"--mask-token-id {mask_id}: it is the tokenizer's {role.removesuffix('_id')} {text!r}, "
                             "a real token of the data; use a spare special token or an unused row")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if text and template and text in template:
        raise ValueError(f"--mask-token-id {mask_id}: the chat template emits {text!r}, so it is a real token of the "
                         "data; use a spare special token or an unused row")


def _widths(hf_config: Any) -> tuple[int, int, int, int]:
    """(hidden, heads, kv_heads, head_dim) of the target; ValueError when they do not divide."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads <= 0 or kv <= 0 or hidden <= 0:
        raise ValueError(f"target config: hidden_size={hidden}, num_attention_heads={heads}, "
                         f"num_key_value_heads={kv} must all be positive")
    if heads % kv:
        raise ValueError(f"target config: num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
                         "grouped-query attention needs whole groups")
    head_dim = getattr(hf_config, "head_dim", None)
    if not head_dim:
        if hidden % heads:
            raise ValueError(f"target config: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                             "and no head_dim is given")
        head_dim = hidden // heads
    return hidden, heads, kv, int(head_dim)


def build_drafter_config(hf_config: Any, tokenizer: Any, *, num_layers: int = 5, block_size: int = 16,
                         layer_types: str | list[str] = "full", sliding_window: int | None = None,
                         target_layer_ids: list[int] | None = None, num_target_features: int = 5,
                         mask_token_id: int | None = None, chat_template: str | None = None
                         ) -> tuple[DrafterConfig, dict[str, Any]]:
    """Validate the choices against the target and build the DrafterConfig.

    hf_config: the target's HF config (text config of a multimodal one is taken). tokenizer: the
    target's tokenizer (None for tokenizer-free test models; then mask_token_id is required).
    Returns (config, info) with info = {mask_token_id, mask_token, mask_token_reason, notes}.
    Raises ValueError naming the CLI flag: --num-layers < 1, --block-size < 2, --sliding-window ≤ 0,
    --target-layer-ids out of range / duplicated / unsorted, --mask-token-id outside the embedding
    or used for a real token, target widths that do not divide, unknown --layer-types.
    """
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    notes: list[str] = []
    if num_layers < 1:
        raise ValueError(f"--num-layers {num_layers}: the drafter needs at least one layer (paper: 5)")
    if block_size < 2:
        raise ValueError(f"--block-size {block_size}: a block is the anchor plus at least one mask slot; use ≥ 2 "
                         "(16 for Qwen3, 10 for Llama-3.1, 8 common)")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"--sliding-window {sliding_window}: must be ≥ 1 (keys within W−1 positions behind the query)")
    _widths(cfg)
    types = resolve_layer_types(layer_types, num_layers)
    if "sliding_attention" in types and sliding_window is None:
        sliding_window = DEFAULT_SLIDING_WINDOW
        notes.append(f"sliding layers use the default window {DEFAULT_SLIDING_WINDOW}")
    if "sliding_attention" not in types and sliding_window is not None:
        notes.append(f"--sliding-window {sliding_window} ignored: no layer slides (--layer-types {layer_types})")
        sliding_window = None
    num_target = int(cfg.num_hidden_layers)
    ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(num_target,
                                                                                                  num_target_features)
    check_target_layer_ids(ids, num_target)
    vocab_rows = int(cfg.vocab_size)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        notes.append("the tokenizer has no chat template; the mask choice cannot check what a template emits")
    if mask_token_id is not None:
        check_mask_token_id(mask_token_id, tokenizer, vocab_rows, chat_template)
    elif tokenizer is None:
        raise ValueError("--mask-token-id: required for a target without a tokenizer")
    dc, reason = drafter_config_from_target(
        cfg, tokenizer, num_layers=num_layers, block_size=block_size, layer_types=types,
        sliding_window=sliding_window, target_layer_ids=ids, mask_token_id=mask_token_id, chat_template=chat_template)
    info = {"mask_token_id": dc.mask_token_id, "mask_token": mask_token_text(tokenizer, dc.mask_token_id),
            "mask_token_reason": reason, "notes": notes}
    return dc, info


def load_target_config(target: str | None, gguf_file: str | None = None) -> tuple[Any, Any, str]:
    """(HF config, tokenizer, name) of a target folder / .gguf / None (embedded), without weights."""
    from transformers import AutoConfig

    from dflash_trainer.target_model.load import load_tokenizer
    from dflash_trainer.target_model.paths import resolve_target_path

    folder, gguf = resolve_target_path(target, gguf_file)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    hf_config = AutoConfig.from_pretrained(str(folder), **kwargs)
    tokenizer = load_tokenizer(target, gguf_file)
    return hf_config, tokenizer, str(folder / gguf) if gguf else str(folder)


def write_drafter_config(path: Path, dc: DrafterConfig, info: dict[str, Any], target: str) -> Path:
    """Write the file `train --drafter-config` reads: DrafterConfig fields + `dflash` metadata."""
    body = {**dc.model_dump(), "dflash": {"target": target, "mask_token": info.get("mask_token"),
                                          "mask_token_reason": info.get("mask_token_reason")}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path
