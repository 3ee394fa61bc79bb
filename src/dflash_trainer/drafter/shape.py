"""A drafter config derived from the target's HF config and tokenizer (no weights are read).

Widths, heads, head_dim, RoPE base, norm epsilon and vocabulary are copied from the target, and so
are the target's functions around its embedding and LM head (embedding_scale, logit_scale,
logit_softcap: `target_model/head_transforms.py`), so the drafter embeds and scores exactly as the
target does;
target_layer_ids follow the DFlash rule (`target_model/layers.py`); the mask token
is an existing embedding row: the first row no tokenizer entry uses, or, when every row is a real
token (SmolLM2: 49152 tokens = 49152 rows), a special token that the chat template never emits and
that is not bos/eos/pad/unk. The vocabulary is never resized. Tokenizers read from a GGUF list the
padding rows the converter appended as placeholder tokens `[PAD{id}]` (Qwen2.5-Coder-0.5B: 151665
real tokens, 271 placeholders up to 151936 rows); those rows count as unused, as they are for the
model's own HF tokenizer.

One builder, `drafter_config_from_target`, serves train (without a drafter config file) and
`dflash-train init-config`; the shape comes from the config's drafter section (`DrafterSection`,
the one home of its defaults and rules: `shape_from_flags` builds it from init-config's flags).
Without a loaded target's head it refuses target families the trainer cannot run exactly
(`target_model/families.py`, which builds the target on the meta device: the one import of torch
here); `write_drafter_config` writes the file `train --drafter-config` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dflash_trainer.config.schema import field_default
from dflash_trainer.config.sections import DrafterSection, check_layer_ids, parse_layer_types
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.target_model.layers import default_target_layer_ids

DEFAULT_SLIDING_WINDOW = 2048
_RESERVED_ROLES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def rope_theta_of(hf_config: Any) -> float:
    """RoPE base of an HF config (transformers 5 keeps it in `rope_parameters`).

    Targets with one base per layer type (Gemma 3: `rope_parameters = {"full_attention": {rope_theta
    1e6}, "sliding_attention": {rope_theta 1e4}}`) give their full-attention base: the drafter's
    layers attend over the whole context, as the target's full-attention layers do.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    full = params.get("full_attention") if isinstance(params, dict) else None
    if isinstance(full, dict) and "rope_theta" in full:
        return float(full["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


def target_widths(hf_config: Any) -> tuple[int, int, int, int]:
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


def real_token_count(tokenizer: Any) -> int:
    """Tokenizer entries up to the trailing GGUF padding placeholders: ids ≥ this are unused rows.

    A GGUF tokenizer lists the embedding rows beyond the real vocabulary as `[PAD{id}]` tokens (the
    converter's vocabulary padding, GGUF token type UNUSED); they are counted off the end. Any other
    tokenizer: `len(tokenizer)`.
    """
    n = len(tokenizer)
    while n > 0 and tokenizer.convert_ids_to_tokens(n - 1) == f"[PAD{n - 1}]":
        n -= 1
    return n


def mask_token_text(tokenizer: Any, mask_token_id: int) -> str | None:
    """The tokenizer's string for the mask id, or None for a row beyond the tokenizer (or a GGUF
    padding placeholder, `real_token_count`)."""
    if tokenizer is None or mask_token_id >= real_token_count(tokenizer):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if mask_token_id in added:
        return str(getattr(added[mask_token_id], "content", added[mask_token_id]))
    return tokenizer.convert_ids_to_tokens(mask_token_id)


def check_mask_token_id(mask_id: int, tokenizer: Any, vocab_rows: int, chat_template: str | None) -> None:
    """Raise ValueError naming `mask_token_id` when the id is not a safe mask row.

    Safe: an embedding row beyond the tokenizer (GGUF padding placeholders included,
    `real_token_count`), or a special token that is none of bos/eos/pad/unk
    and that the chat template (`chat_template`, else the tokenizer's) never emits. Refused: ids
    outside the embedding (the vocabulary is never resized), ids the tokenizer uses for an ordinary
    token, bos/eos/pad/unk and specials the template emits (all are real tokens of the data).
    tokenizer None: only the range is checked.
    """
    if not 0 <= mask_id < vocab_rows:
        raise ValueError(f"mask_token_id={mask_id} is outside the vocabulary ({vocab_rows} rows); the vocabulary is "
                         "never resized, pick an existing row")
    if tokenizer is None or mask_id >= real_token_count(tokenizer):
        return
    text = mask_token_text(tokenizer, mask_id)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if mask_id not in added:
        raise ValueError(f"mask_token_id={mask_id}: the tokenizer uses it for the real token {text!r}; use an "
                         f"unused row (≥ {real_token_count(tokenizer)}) or a spare special token")
    for role in _RESERVED_ROLES:
        if getattr(tokenizer, role, None) == mask_id:
            raise ValueError(f"mask_token_id={mask_id}: it is the tokenizer's {role.removesuffix('_id')} {text!r}, "
                             "a real token of the data; use a spare special token or an unused row")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if text and template and text in template:
        raise ValueError(f"mask_token_id={mask_id}: the chat template emits {text!r}, so it is a real token of the "
                         "data; use a spare special token or an unused row")


def choose_mask_token(tokenizer: Any, vocab_rows: int, chat_template: str | None = None) -> tuple[int, str]:
    """Pick the mask token id and say why.

    Returns (id, reason). Prefers the first embedding row beyond the tokenizer (`real_token_count`
    < vocab_rows). Otherwise the first added special token that `check_mask_token_id` accepts.
    Raises ValueError naming `mask_token_id` if none exists or there is no tokenizer.
    """
    if tokenizer is None:
        raise ValueError("mask_token_id: required for a target without a tokenizer; pass --mask-token-id ID "
                         "(init-config) or --set mask_token_id=ID (train)")
    n_tok = real_token_count(tokenizer)
    if n_tok < vocab_rows:
        pads = len(tokenizer) - n_tok
        extra = f" + {pads} GGUF padding placeholders [PADn]" if pads else ""
        return n_tok, f"first unused embedding row ({n_tok} tokenizer entries{extra}, {vocab_rows} rows)"
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for tid in sorted(added):
        if tid >= vocab_rows or not mask_token_text(tokenizer, tid):
            continue
        try:
            check_mask_token_id(tid, tokenizer, vocab_rows, chat_template)
        except ValueError:
            continue
        return int(tid), (f"special token {mask_token_text(tokenizer, tid)!r} (id {tid}): every row is a real token "
                          "and the chat template never emits it")
    raise ValueError("mask_token_id: the target has no unused embedding row and no spare special token; pass "
                     "--mask-token-id ID (init-config) or --set mask_token_id=ID (train)")


def check_fits_target(dc: DrafterConfig, target: Any, where: str, fix: str) -> None:
    """The one check of a drafter config against a loaded target (train, eval).

    target: a TargetBundle (model, hidden_size, vocab_size, num_layers, name_or_path). Raises
    ValueError starting with `where` and ending with `fix` when hidden size, vocabulary rows or the
    target's decoder-layer count differ, or when the config's embedding_scale / logit_scale /
    logit_softcap differ from the target's (`head_transforms.target_head`). Runs the target once on a
    few tokens (`check_target_head`) and refuses, with one line, a target whose first-layer input or
    logits those three fields do not reproduce.
    """
    from dflash_trainer.target_model.head_transforms import check_drafter_head, check_target_head, target_head

    got = (dc.hidden_size, dc.vocab_size, dc.num_target_layers)
    if got != (target.hidden_size, target.vocab_size, target.num_layers):
        raise ValueError(f"{where}: widths (hidden {dc.hidden_size}, vocab {dc.vocab_size}, target layers "
                         f"{dc.num_target_layers}) do not match the target {target.name_or_path} (hidden "
                         f"{target.hidden_size}, vocab {target.vocab_size}, layers {target.num_layers}); {fix}")
    head = target_head(target.model)
    check_target_head(target, head)
    check_drafter_head(dc, head, where, fix)


def check_drafter_flags(num_layers: int, block_size: int, layer_types: str | list[str],
                        sliding_window: int | None) -> list[str]:
    """The per-layer attention types of `init-config`'s shape flags, after checking them (no target
    needed: the CLI runs this before loading anything). Raises ValueError naming the flag for
    --num-layers < 1, --block-size < 2, --sliding-window ≤ 0 and an unknown --layer-types."""
    if num_layers < 1:
        raise ValueError(f"--num-layers {num_layers}: the drafter needs at least one layer (paper: 5)")
    if block_size < 2:
        raise ValueError(f"--block-size {block_size}: a block is the anchor plus at least one mask slot; use ≥ 2 "
                         "(16 for Qwen3, 10 for Llama-3.1, 8 common)")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"--sliding-window {sliding_window}: must be ≥ 1 (keys within W−1 positions behind the query)")
    try:
        return parse_layer_types(layer_types, num_layers)
    except ValueError as e:  # the same reason, under the flag's name
        raise ValueError(f"--layer-types {layer_types!r}: {str(e).removeprefix('layer_types: ')}") from None


def shape_from_flags(*, num_layers: int = field_default("drafter.num_layers"),
                     block_size: int = field_default("drafter.block_size"),
                     layer_types: str = field_default("drafter.layer_types"), sliding_window: int | None = None,
                     target_layer_ids: list[int] | None = None,
                     num_target_features: int = field_default("drafter.num_target_features"),
                     mask_token_id: int | None = None) -> tuple[DrafterSection, list[str]]:
    """`init-config`'s shape flags as the config's drafter section (DrafterSection: the one home of
    the shape's defaults and rules), with the notes (list[str]) of what was filled in: sliding
    layers without a window get DEFAULT_SLIDING_WINDOW; a window without sliding layers is dropped.
    No target needed (the CLI and the pre-flight run this before loading anything). Raises
    ValueError naming the flag for --num-layers < 1, --block-size < 2, --sliding-window ≤ 0, an
    unknown --layer-types and whatever else the section refuses (a B that does not divide 128,
    --target-layer-ids not ascending)."""
    types = check_drafter_flags(num_layers, block_size, layer_types, sliding_window)
    notes: list[str] = []
    if "sliding_attention" in types and sliding_window is None:
        sliding_window = DEFAULT_SLIDING_WINDOW
        notes.append(f"sliding layers use the default window {DEFAULT_SLIDING_WINDOW}")
    if "sliding_attention" not in types and sliding_window is not None:
        notes.append(f"--sliding-window {sliding_window} ignored: no layer slides (--layer-types {layer_types})")
        sliding_window = None
    values = dict(num_layers=num_layers, block_size=block_size, layer_types=layer_types,
                  sliding_window=sliding_window, target_layer_ids=target_layer_ids,
                  num_target_features=num_target_features, mask_token_id=mask_token_id)
    try:
        return DrafterSection(**values), notes
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else next((k for k in values if err["msg"].find(k) >= 0), "")
        msg = err["msg"].removeprefix("Value error, ")
        named = field not in values or msg.startswith(field)  # the section's own messages name the field
        raise ValueError(msg if named else f"--{field.replace('_', '-')} {values[field]!r}: {msg}") from None


def drafter_config_from_target(hf_config: Any, tokenizer: Any, shape: DrafterSection, *,
                               chat_template: str | None = None, head: Any = None
                               ) -> tuple[DrafterConfig, dict[str, Any]]:
    """The one builder of a DrafterConfig from a target (train without a drafter config file, and
    `init-config`): widths and embedding / logits functions copied from the target, the shape from
    `shape` (the config's drafter section, already checked by its validator).

    hf_config: the target's HF config (the text config of a multimodal one is taken). tokenizer:
    the target's tokenizer (None for tokenizer-free test models; then shape.mask_token_id is
    required). chat_template: the template the data will use (None = the tokenizer's). head: the
    loaded target's `head_transforms.TargetHead`; None = check the target family on the meta device
    (`families.support_from_config`, refusing one the trainer cannot run exactly) and take its head.
    Returns (config, info) with info = {mask_token_id, mask_token, mask_token_reason, notes,
    target_needs}. Raises ValueError naming the field: target widths that do not divide
    (`target_widths`), target_layer_ids out of the target's range (`check_layer_ids`), a
    mask_token_id that is not a safe mask row (`check_mask_token_id`), an unsupported family.
    """
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden, heads, kv, head_dim = target_widths(cfg)  # widths first: their errors name the config field
    needs: list[str] = []
    if head is None:
        from dflash_trainer.target_model.families import check_supported, support_from_config

        support = check_supported(support_from_config(hf_config))
        head, needs = support.head, support.summary()
    notes: list[str] = []
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        notes.append("the tokenizer has no chat template; the mask choice cannot check what a template emits")
    L = int(cfg.num_hidden_layers)
    vocab = int(cfg.vocab_size)
    ids = (check_layer_ids(shape.target_layer_ids, L) if shape.target_layer_ids is not None
           else default_target_layer_ids(L, shape.num_target_features))
    mask_token_id = shape.mask_token_id
    if mask_token_id is None:
        mask_token_id, reason = choose_mask_token(tokenizer, vocab, chat_template)
    else:
        check_mask_token_id(mask_token_id, tokenizer, vocab, chat_template)
        reason = "given explicitly"
    dc = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=int(cfg.intermediate_size),
        num_hidden_layers=shape.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(cfg),
        vocab_size=vocab,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
        block_size=shape.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=ids,
        num_target_layers=L,
        layer_types=shape.resolved_layer_types(),
        sliding_window=shape.sliding_window,
        **head.fields(),
    )
    info = {"mask_token_id": dc.mask_token_id, "mask_token": mask_token_text(tokenizer, dc.mask_token_id),
            "mask_token_reason": reason, "notes": notes, "target_needs": needs}
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
