"""Which attention kernel the frozen target runs over packed rows, and the masks it is given.

Shapes: R = rows, T = packed tokens per row, W = sliding window.

Three paths, same visibility (`packed_masks.py`):
  * "sdpa": transformers' SDPA attention with a dense boolean [R,1,T,T] mask. Works for any T on
    any device; the mask rules out SDPA's fast causal kernels (363.5 ms against 272.8 ms for plain
    causal: Qwen3-8B shape, T = 8192 in 8 documents, features only, i.e. up to the last feature layer;
    one H200, benchmarks/results/bench-target_h200_2026-12-01.json).
  * "flex": transformers' own flex attention (`integrations/flex_attention.py`, compiled
    `flex_attention`) with a document-causal `BlockMask` built directly from the position ids:
    tiles outside every document are skipped (244.4 ms in that run, 1.49× the dense path).
    Needs T % 128 == 0 and a model class that supports flex (`_supports_flex_attn`).
  * "eager": transformers' own attention math of the model class with the dense mask made additive
    (0 / dtype min). Materializes the [T,T] scores per head (slow) but runs what SDPA cannot:
    attention sinks (gpt-oss) and logit soft-capping (Gemma 2).
Setting `target_attention`: "auto" = flex on CUDA when it applies, else the dense path that is exact
for the family (sdpa, or eager where SDPA would be wrong; `families.py`), with a warning on CUDA;
"flex" / "sdpa" / "eager" force a path ("flex" runs on CPU too: forward only, which is all a frozen
target needs), and a forced path that cannot give exact features is refused with the reason.

How transformers takes the masks (checked in transformers 5.24, the same code in 5.17): a 4D
tensor or a BlockMask passed as `attention_mask` is returned as is by `create_causal_mask` /
`create_sliding_window_causal_mask` (`masking_utils._preprocess_mask_arguments`). Models with
`config.layer_types` (Qwen2/3, Gemma, Ministral, …) also take a dict {layer type: mask} and give
each decoder layer the mask of its type, so sliding-window layers get a second mask with the
window built in, on both paths. Models without `layer_types` whose config has `sliding_window`
(Mistral) slide on every layer: one windowed mask. The kernel is chosen per attention call from
`config._attn_implementation`, so `use_attention` switches it only around one forward and
restores it after (transformers' `set_attn_implementation` checks the model once, up front).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from dflash_trainer.target_model.packed_masks import TILE, document_block_masks, packed_causal_mask

TargetAttention = Literal["auto", "flex", "sdpa", "eager"]
ATTENTION_CHOICES = ("auto", "flex", "sdpa", "eager")
_HF_NAME = {"flex": "flex_attention", "sdpa": "sdpa", "eager": "eager"}


def check_attention(attention: str) -> str:
    """The setting itself; ValueError naming `target_attention` for anything but auto|flex|sdpa|eager."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"target_attention={attention!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    return attention


def flex_unsupported_reason(model: nn.Module) -> str | None:
    """None when transformers can run this model with flex attention, else why not (one line).

    Asks transformers itself: switches to "flex_attention" with `set_attn_implementation` (which
    checks the model class and the torch build) and back.
    """
    if not hasattr(model, "set_attn_implementation"):
        return f"{type(model).__name__} is not a transformers PreTrainedModel"
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation("flex_attention")
    except (ValueError, ImportError) as e:
        return f"{type(model).__name__}: {str(e).splitlines()[0]}"
    finally:
        model.set_attn_implementation(before)
    return None


def resolve_attention(attention: str, *, device: torch.device, seq_len: int, flex_reason: str | None,
                      sdpa_reason: str | None = None) -> str:
    """The path ("flex" | "sdpa" | "eager") one forward of R×`seq_len` tokens on `device` takes.

    attention: the setting (auto|flex|sdpa|eager). flex_reason / sdpa_reason: why that path cannot
    give exact features for this model (`families.TargetSupport`), or None. The dense path is sdpa,
    or eager when sdpa_reason is set. "auto" takes flex on CUDA when it can, else the dense path
    (silently off CUDA, with a warning naming the reason on CUDA). Raises ValueError naming
    `target_attention` and the way out when a forced path cannot run (flex: flex_reason or
    T % 128 != 0; sdpa: sdpa_reason).
    """
    check_attention(attention)
    dense = "eager" if sdpa_reason else "sdpa"
    if attention == "eager":
        return "eager"
    if attention == "sdpa":
        if sdpa_reason:
            raise ValueError(f"target_attention=sdpa: {sdpa_reason}; use target_attention=auto (it picks a path that "
                             "works) or eager")
        return "sdpa"
    why_not = flex_reason or (None if seq_len % TILE == 0 else
                              f"T={seq_len} is not a multiple of {TILE} (the flex tile)")
    if attention == "flex":
        if why_not:
            raise ValueError(f"target_attention=flex: {why_not}; use target_attention=auto (it picks a path that "
                             f"works) or {dense}")
        return "flex"
    if device.type != "cuda":
        return dense
    if why_not:
        warnings.warn(f"target_attention=auto: the target runs {dense.upper()} with a dense mask because {why_not}",
                      stacklevel=3)
        return dense
    return "flex"


def _layer_windows(config: Any, seq_len: int) -> tuple[int | None, dict[str, int | None] | None]:
    """(window of a single mask, None) or (None, {layer type: window}) for a target config.

    Raises ValueError for layer types other than full/sliding attention or a sliding layer type
    without `config.sliding_window`. A window ≥ T is dropped (it hides nothing).
    """
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    window = int(window) if window is not None and int(window) < seq_len else None
    if layer_types:
        kinds = set(layer_types)
        unknown = kinds - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"target layer_types {sorted(unknown)} are not supported by the packed-row mask "
                             "(only full_attention and sliding_attention)")
        if "sliding_attention" not in kinds:
            return None, None
        if getattr(config, "sliding_window", None) is None:
            raise ValueError("target has sliding_attention layers but config.sliding_window is None")
        return None, {"full_attention": None, "sliding_attention": window}
    if getattr(config, "use_sliding_window", True) is not False:
        return window, None
    return None, None


def attention_masks_for(config: Any, position_ids: torch.Tensor, implementation: str = "sdpa",
                        dtype: torch.dtype = torch.float32) -> Any:
    """The `attention_mask` argument for a packed forward of a target with this config.

    position_ids: [R,T] on the target's device. implementation: "sdpa" → dense bool [R,1,T,T]
    masks; "eager" → the same masks additive in `dtype` (0 = attend, dtype min = hidden: what
    transformers' eager attention adds to the scores); "flex" → BlockMasks (all windows from one
    build, no host sync). Returns one mask, or a dict keyed by layer type when the target mixes full
    and sliding layers. Raises ValueError for unsupported layer types (see `_layer_windows`) or, on
    flex, T % 128 != 0.
    """
    T = position_ids.shape[-1]
    single, per_type = _layer_windows(config, T)
    windows = list(per_type.values()) if per_type else [single]
    if implementation == "flex":
        built = document_block_masks(position_ids, windows)
    elif implementation == "sdpa":
        built = {w: packed_causal_mask(position_ids, w) for w in dict.fromkeys(windows)}
    elif implementation == "eager":
        seen = torch.zeros((), dtype=dtype, device=position_ids.device)
        hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=position_ids.device)
        built = {w: torch.where(packed_causal_mask(position_ids, w), seen, hidden)  # [R,1,T,T] additive
                 for w in dict.fromkeys(windows)}
    else:
        raise ValueError(f"implementation={implementation!r}: use flex, sdpa or eager")
    if per_type:
        return {kind: built[w] for kind, w in per_type.items()}
    return built[single]


@contextmanager
def use_attention(model: nn.Module, implementation: str) -> Iterator[None]:
    """Run the body with the model's attention set to `implementation` ("flex" | "sdpa" | "eager"), then
    restore the previous setting (also when the body raises). A no-op when it is already set."""
    name = _HF_NAME[implementation]
    config = model.config
    before = config._attn_implementation
    if before == name:
        yield
        return
    # The config setter (also on sub-configs) is all the attention calls read; transformers'
    # checks for this model ran once in `flex_unsupported_reason`, so none are repeated per forward.
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
