"""One frozen target forward over packed rows → drafter features and target labels.

Shapes: R = rows, T = packed tokens per row, H = hidden size, k = number of target layers,
V = vocabulary, L = decoder layers, W = sliding window.

Features: layer id ℓ is the OUTPUT of decoder layer ℓ (HF `hidden_states[ℓ + 1]`), taken with
forward hooks on the k decoder layers and copied into one preallocated [R,T,k·H] buffer, so no
concat and no tuple of L+1 hidden states is ever kept. Note for ℓ = L−1: transformers 5 replaces
the last entry of `hidden_states` by the final-normed state; the hook returns the raw output of
the last layer, which is the consistent definition (the default rule never picks ℓ = L−1).

Packed rows: the start of the document holding position p is p − position_ids[p]. Query q sees
key p iff start(p) = start(q) and p ≤ q. This is realized as a 4D boolean mask [R,1,T,T]
(True = attend) passed as `attention_mask`, with `position_ids` so RoPE restarts per document.
transformers 5 (`masking_utils._preprocess_mask_arguments`, checked in 5.24; 5.17 is the same
code path) returns any 4D mask "as is" from `create_causal_mask` /
`create_sliding_window_causal_mask`, and `sdpa_attention_forward` hands a boolean mask straight
to `F.scaled_dot_product_attention` (True = attend), with `is_causal=False` because a mask is
given. A 4D mask skips the window of sliding-window layers, so for such targets the window
(q − p < W, transformers' `sliding_window_overlay`) is built into the mask here: targets with
`layer_types` (Qwen2/3, Gemma, Ministral, ...) get a dict {"full_attention", "sliding_attention"}
of masks (their forward accepts a prepared mapping); targets without `layer_types` whose config
has a `sliding_window` (Mistral) get the windowed mask for all layers.

Labels: the target's greedy next-token prediction at every position, argmax of
lm_head(final norm(last hidden)), computed in chunks of positions so [R·T, V] logits never exist
at once. Positive logit scaling and tanh soft-capping (some model families) do not change an
argmax and are not applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_trainer.target.layers import check_target_layer_ids
from dflash_trainer.target.load import TargetBundle, find_base_model, find_decoder_layers


@dataclass
class TargetOutput:
    """features [R,T,k·H] in the target's dtype (detached); argmax [R,T] int64 or None;
    last_hidden [R,T,H] final-normed target states (for KL distillation) or None."""

    features: torch.Tensor
    argmax: torch.Tensor | None
    last_hidden: torch.Tensor | None = None


class _StopForward(Exception):
    """Raised by the hook on the last needed layer to skip the remaining layers."""


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[R,T] int64: index of the first token of the document holding each position (p − pos[p])."""
    T = position_ids.shape[-1]
    idx = torch.arange(T, device=position_ids.device, dtype=torch.long)
    return idx - position_ids.long()


def packed_causal_mask(position_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """4D boolean attention mask [R,1,T,T] for packed rows; True = attend.

    Query q sees key p iff both lie in the same document (equal document starts, derived from
    position ids) and p ≤ q; with `sliding_window` W also q − p < W. Built by broadcasting
    [R,T,1] against [R,1,T]: no [num_docs, T] temporary, no host sync.
    """
    start = document_starts(position_ids)  # [R,T]
    T = start.shape[-1]
    idx = torch.arange(T, device=start.device)
    causal = idx[None, :] <= idx[:, None]  # [T(q),T(k)]
    if sliding_window is not None:
        causal &= (idx[:, None] - idx[None, :]) < sliding_window
    same_doc = start[:, :, None] == start[:, None, :]  # [R,T(q),T(k)]
    return (same_doc & causal).unsqueeze(1)  # [R,1,T,T]


def attention_masks_for(config: Any, position_ids: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` argument for a packed forward of a target with this config.

    A single [R,1,T,T] mask, or a dict keyed by layer type when the target mixes full and sliding
    layers. Raises ValueError for layer types other than full/sliding attention.
    """
    T = position_ids.shape[-1]
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    full = packed_causal_mask(position_ids)
    if layer_types:
        kinds = set(layer_types)
        unknown = kinds - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"target layer_types {sorted(unknown)} are not supported by the packed-row mask "
                             "(only full_attention and sliding_attention)")
        if "sliding_attention" not in kinds:
            return full
        if window is None:
            raise ValueError("target has sliding_attention layers but config.sliding_window is None")
        sliding = packed_causal_mask(position_ids, int(window)) if T > int(window) else full
        return {"full_attention": full, "sliding_attention": sliding}
    if window is not None and getattr(config, "use_sliding_window", True) is not False and T > int(window):
        return packed_causal_mask(position_ids, int(window))
    return full


class TargetFeatureExtractor:
    """Frozen target forward over packed rows → TargetOutput(features, argmax).

    target_layer_ids: strictly increasing ids in [0, L−1] (ValueError otherwise); id ℓ = output of
    decoder layer ℓ. argmax_chunk: positions per LM-head chunk for the greedy labels.
    """

    def __init__(self, target: TargetBundle, target_layer_ids: list[int], *, argmax_chunk: int = 1024):
        self.target = target
        self.layer_ids = check_target_layer_ids(target_layer_ids, target.num_layers)
        self.argmax_chunk = int(argmax_chunk)
        if self.argmax_chunk < 1:
            raise ValueError(f"argmax_chunk={argmax_chunk}: must be at least 1")
        self.model = target.model
        self.base = find_base_model(self.model)
        self.layers = find_decoder_layers(self.model)
        self.config = self.base.config if hasattr(self.base, "config") else target.config

    @property
    def num_features(self) -> int:
        """k·H: width of the concatenated features."""
        return len(self.layer_ids) * self.target.hidden_size

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        w = self.target.embed_tokens.weight
        return w.device, w.dtype

    @torch.no_grad()  # not inference_mode: the features feed the drafter's autograd graph
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                 need_argmax: bool = True, need_last_hidden: bool = False) -> TargetOutput:
        """input_ids, position_ids [R,T] int64 (positions restart at 0 in each document).

        Returns features [R,T,k·H] (target dtype, on the target's device) and argmax [R,T] int64
        (None when need_argmax is False; then layers after max(target_layer_ids) are skipped, unless
        need_last_hidden asks for the final-normed states [R,T,H] used by the KL loss).
        """
        if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                             "must both be [R,T]")
        device, dtype = self._device_dtype()
        input_ids = input_ids.to(device=device, dtype=torch.long)
        position_ids = position_ids.to(device=device, dtype=torch.long)
        R, T = input_ids.shape
        H = self.target.hidden_size
        features = torch.empty(R, T, len(self.layer_ids) * H, device=device, dtype=dtype)  # [R,T,k·H]
        last_needed = self.layer_ids[-1]

        def make_hook(j: int, layer_id: int):
            def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                hidden = output[0] if isinstance(output, (tuple, list)) else output  # [R,T,H]
                features[:, :, j * H:(j + 1) * H].copy_(hidden)
                if not need_argmax and not need_last_hidden and layer_id == last_needed:
                    raise _StopForward
            return hook

        handles = [self.layers[i].register_forward_hook(make_hook(j, i)) for j, i in enumerate(self.layer_ids)]
        mask = attention_masks_for(self.config, position_ids)
        last_hidden = None
        try:
            out = self.base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
            last_hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [R,T,H], normed
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        del mask

        argmax = None
        if need_argmax:
            assert last_hidden is not None
            argmax = self._chunked_argmax(last_hidden.reshape(R * T, H)).view(R, T)
        return TargetOutput(features=features, argmax=argmax, last_hidden=last_hidden if need_last_hidden else None)

    def _chunked_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N,H] (final-normed) → argmax of lm_head(hidden) [N] int64, chunk by chunk."""
        head = self.target.lm_head
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.long, device=hidden.device)
        for s in range(0, n, self.argmax_chunk):
            e = min(s + self.argmax_chunk, n)
            out[s:e] = head(hidden[s:e]).argmax(dim=-1)  # [chunk,V] logits live only here
        return out
