"""One sequence of any HF causal LM over transformers' own KV cache, behind the interface of
`BatchedTarget` (decoding/batched.py): what the decoding engine (decoding/engine.py) runs for
target families the static-cache path does not implement (Gemma 2, Phi-3, OLMo-2, gpt-oss,
DeepSeek-V3, Granite, …; `batched.unsupported_reason`).

The model's own forward computes everything a family needs (scaled embeddings, extra norms,
attention sinks, soft-capping, MLA, its logits function), so the target's tokens and logits are
exactly the HF model's. Rejected drafts are dropped by cropping the cache to the next round's
start (`DynamicCache.crop`), which is why only one row is decoded at a time and why families with
state across positions are refused before (evaluation/run.py `check_decodable`). Every `step`
reads its start position on the host (one sync per call): eager only, never CUDA-graph captured
(`graphable` False).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from dflash_trainer.config.sections import check_layer_ids
from dflash_trainer.target_model.load import TargetBundle, find_base_model, find_decoder_layers


class HFCacheTarget:
    """The `BatchedTarget` interface (prefill / step, rows = 1) over the HF model's forward.

    layer_ids: target layers whose outputs are returned as features (id ℓ = output of decoder
    layer ℓ, as in training). Raises ValueError for rows != 1.
    """

    graphable = False  # steps read the host: the engine replays no graphs over this target

    def __init__(self, target: TargetBundle, *, rows: int, max_len: int, layer_ids: list[int] | None = None):
        if rows != 1:
            raise ValueError(f"rows={rows}: {type(target.model).__name__} decodes one sequence at a time here "
                             "(HF cache path); use batch size 1")
        self.target, self.model = target, target.model
        self.base = find_base_model(target.model)
        self.layers = find_decoder_layers(target.model)
        self.layer_ids = check_layer_ids(layer_ids, target.num_layers) if layer_ids else []
        w = target.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        self.rows, self.max_len = 1, max_len
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers ≥ 5.2x: `cache`
        self.cache: Any = None
        self.length = 0  # cached positions 0 … length−1

    @property
    def feature_width(self) -> int:
        """k·H, the width of the returned features."""
        return len(self.layer_ids) * self.target.hidden_size

    @torch.no_grad()
    def prefill(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, *,
                with_features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Start the sequence from its prompt: tokens [1,P] long (right-padded), lengths [1].
        Returns (logits fp32 [1,V] of the prompt's last token, features [1,P,k·H] in the target
        dtype (zeros past the prompt) or None)."""
        from transformers import DynamicCache

        if tokens.shape[0] != 1:
            raise ValueError(f"tokens {tuple(tokens.shape)}: one prompt at a time on the HF cache path")
        n = int(lengths[0])  # host read: this path is eager
        self.cache, self.length = DynamicCache(), 0
        logits, feats = self._forward(tokens[:, :n], with_features, last_only=True)
        if feats is not None and n < tokens.shape[1]:
            feats = torch.cat([feats, feats.new_zeros(1, tokens.shape[1] - n, feats.shape[-1])], dim=1)
        return logits[:, -1], feats

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, start: torch.Tensor, span: int, *, with_features: bool = False,
             all_logits: bool = True, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens [1,n] at positions start … start+n−1 after dropping cached positions ≥ start
        (the previous round's rejected drafts). span is ignored (the cache holds what it holds), and so
        is greedy (`BatchedTarget.step`'s: one row's logits are cheap to convert).
        Returns (logits fp32 [1,n,V], or [1,V] when all_logits is False; features [1,n,k·H] or None).
        Raises ValueError when start is past the cached length (a gap)."""
        s = int(start[0])  # host read: this path is eager
        if s > self.length:
            raise ValueError(f"step at position {s} but only {self.length} positions are cached")
        if s < self.length:
            self.cache.crop(s - self.length)  # negative = positions to drop from the end
            self.length = s
        logits, feats = self._forward(tokens, with_features, last_only=not all_logits)
        return (logits if all_logits else logits[:, -1]), feats

    def _forward(self, ids: torch.Tensor, with_features: bool,
                 last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [1,n] at positions length … length+n−1, appended to the cache -> (logits fp32 [1,n,V],
        or [1,1,V] of the last token when last_only; features [1,n,k·H] or None)."""
        n, H = ids.shape[1], self.target.hidden_size
        pos = torch.arange(self.length, self.length + n, device=self.device)[None]  # [1,n]
        feats, handles = None, []
        if with_features:
            if not self.layer_ids:
                raise ValueError("with_features=True but no target layer ids were given")
            feats = torch.empty(1, n, self.feature_width, device=self.device, dtype=self.dtype)

            def make_hook(j: int):
                def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                    hidden = output[0] if isinstance(output, (tuple, list)) else output  # [1,n,H]
                    feats[:, :, j * H:(j + 1) * H].copy_(hidden)
                return hook

            handles = [self.layers[i].register_forward_hook(make_hook(j)) for j, i in enumerate(self.layer_ids)]
        try:
            out = self.model(input_ids=ids.to(self.device), position_ids=pos, use_cache=True,
                             logits_to_keep=1 if last_only else 0, **{self._cache_arg: self.cache})
        finally:
            for h in handles:
                h.remove()
        self.length += n
        return out.logits.float(), feats
