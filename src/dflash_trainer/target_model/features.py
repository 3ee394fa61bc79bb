"""One frozen target forward over packed rows → drafter features and target labels.

Shapes: R = rows, T = packed tokens per row, H = hidden size, k = number of target layers,
V = vocabulary, L = decoder layers, W = sliding window.

Features: layer id ℓ is the OUTPUT of decoder layer ℓ (HF `hidden_states[ℓ + 1]`), taken with
forward hooks on the k decoder layers and copied into one preallocated [R,T,k·H] buffer, so no
concat and no tuple of L+1 hidden states is ever kept. Note for ℓ = L−1: transformers 5 replaces
the last entry of `hidden_states` by the final-normed state; the hook returns the raw output of
the last layer, which is the consistent definition (the default rule never picks ℓ = L−1).

Packed rows: the start of the document holding position p is p − position_ids[p]. Query q sees
key p iff start(p) = start(q) and p ≤ q (and q − p < W on sliding-window layers), with
`position_ids` passed so RoPE restarts per document. The mask is realized for the attention path
chosen per forward (`attention.py`, setting `target_attention`): a dense [R,1,T,T] boolean mask for
SDPA (CPU), the same mask made additive for transformers' eager attention (families SDPA cannot run
exactly: attention sinks, soft-capping), or a document-causal flex BlockMask built from the position
ids (CUDA), per layer type when the target mixes full and sliding layers (`packed_masks.py`,
`attention.py`). Targets whose layers carry state across positions (linear attention, Mamba, short
convolutions) run one forward per document instead (`per_document.py`); `families.py` decides, and
refuses what cannot be run exactly.

Compiled layers: on the flex path on CUDA the decoder layers' `forward` runs through `torch.compile`
(regional compilation: dynamo caches by code object, so all layers of one type share one graph,
compiled on first use; a new batch shape, e.g. validation's one row, compiles once more). Inductor fuses what eager HF runs as separate memory-bound kernels
(RMSNorm's upcast/pow/mean/rsqrt/mul chain, RoPE, SiLU·up, residual adds). The compiled forward is
swapped in only for this extractor's own forwards and removed after, so the same model serves KV-cache
decoding (evaluation) eagerly. Fused kernels round once where eager rounds between ops: features
differ from eager by bf16 rounding, not by definition (tests/gpu/test_target_flex_cuda.py bounds both
against an fp32 forward; tests/unit/test_target_flex.py checks the tracing and the swap on CPU).

Profiler sections (telemetry/sections.py, ranges only while a profiler records): target_layers
(masks, decoder layers, feature copies) and target_labels (the chunked LM head + argmax).

Labels: the target's greedy next-token prediction at every position, argmax of
lm_head(final norm(last hidden)), computed in chunks of positions so [R·T, V] logits never exist
at once. Positive logit scaling and tanh soft-capping (some model families) do not change an
argmax and are not applied (`families.py` refuses a non-positive scale).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.target_model.attention import (
    attention_masks_for,
    check_attention,
    flex_unsupported_reason,
    resolve_attention,
    use_attention,
)
from dflash_trainer.target_model.families import TargetSupport, check_supported, target_support
from dflash_trainer.config.sections import check_layer_ids
from dflash_trainer.target_model.load import TargetBundle, find_base_model, find_decoder_layers
from dflash_trainer.target_model.packed_masks import document_starts, packed_causal_mask
from dflash_trainer.target_model.per_document import document_batches, scatter
from dflash_trainer.telemetry.sections import section

# Re-exported: the mask helpers lived here first.
__all__ = ["TargetFeatureExtractor", "TargetOutput", "attention_masks_for", "document_starts", "packed_causal_mask"]


@dataclass
class TargetOutput:
    """features [R,T,k·H] in the target's dtype (detached); argmax [R,T] int64 or None;
    last_hidden [R,T,H] final-normed target states (for KL distillation) or None."""

    features: torch.Tensor
    argmax: torch.Tensor | None
    last_hidden: torch.Tensor | None = None


class _StopForward(Exception):
    """Raised by the hook on the last needed layer to skip the remaining layers."""


class TargetFeatureExtractor:
    """Frozen target forward over packed rows → TargetOutput(features, argmax).

    target_layer_ids: strictly increasing ids in [0, L−1] (ValueError otherwise); id ℓ = output of
    decoder layer ℓ. argmax_chunk: positions per LM-head chunk for the greedy labels.
    attention: auto | flex | sdpa | eager (`attention.py`; auto = flex on CUDA when the model
    supports it and T % 128 == 0, else sdpa, or eager where sdpa would be wrong). ValueError for
    another value, for a refused target (`families.py`: the one-line reason), or for a forced path
    that cannot give exact features for this model ("sdpa" with attention sinks or soft-capping,
    "flex" without flex support, with sinks on CPU, or on a target run one document at a time).
    compile_layers: None (default) = compile the decoder layers for forwards on the flex path on
    CUDA (see the module docstring); True = for every forward (tests on CPU); False = never.
    """

    def __init__(self, target: TargetBundle, target_layer_ids: list[int], *, argmax_chunk: int = 1024,
                 attention: str = "auto", compile_layers: bool | None = None):
        self.target = target
        self.layer_ids = check_layer_ids(target_layer_ids, target.num_layers)
        self.argmax_chunk = int(argmax_chunk)
        if self.argmax_chunk < 1:
            raise ValueError(f"argmax_chunk={argmax_chunk}: must be at least 1")
        self.attention = check_attention(attention)
        self.model = target.model
        self.base = find_base_model(self.model)
        self.layers = find_decoder_layers(self.model)
        self.config = self.base.config if hasattr(self.base, "config") else target.config
        self.support: TargetSupport = check_supported(target_support(self.model))
        device, _ = self._device_dtype()
        self._sdpa_reason = self.support.unsupported.get("sdpa")
        self._flex_reason = None
        if attention in ("auto", "flex"):
            self._flex_reason = self.support.flex_reason(device) or flex_unsupported_reason(self.model)
        if attention != "auto":  # a forced path that cannot be exact fails here, before any forward
            resolve_attention(attention, device=device, seq_len=0, flex_reason=self._flex_reason,
                              sdpa_reason=self._sdpa_reason)
        self.compile_layers = compile_layers
        self._compiled: list[Any] | None = None  # compiled `forward` of each decoder layer, made on first use

    @classmethod
    def from_config(cls, target: TargetBundle, target_layer_ids: list[int], cfg: TrainConfig) -> "TargetFeatureExtractor":
        """The extractor a training run uses: `cfg` (a TrainConfig) gives target_attention and
        target_compile (true = compiled layers where they pay, on the flex path on CUDA). The KL and
        cat losses read the target's distribution through the drafter config's logits function
        (logit_scale, logit_softcap: the target's own), so no loss is refused for a family here."""
        return cls(target, target_layer_ids, attention=cfg.target.target_attention,
                   compile_layers=None if cfg.target.target_compile else False)

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        w = self.target.embed_tokens.weight
        return w.device, w.dtype

    @property
    def per_document(self) -> bool:
        """True when each document runs as its own forward (stateful layers; `per_document.py`)."""
        return self.support.per_document

    def implementation_for(self, seq_len: int) -> str:
        """The attention path ("flex" | "sdpa" | "eager") a forward of rows of `seq_len` tokens takes."""
        if self.per_document and self.attention == "auto":
            return self.support.dense_path  # no packed mask to realize: flex has nothing to skip
        device, _ = self._device_dtype()
        return resolve_attention(self.attention, device=device, seq_len=seq_len, flex_reason=self._flex_reason,
                                 sdpa_reason=self._sdpa_reason)

    def compiles(self, implementation: str) -> bool:
        """Whether a forward on the `implementation` path ("flex" | "sdpa" | "eager") runs compiled layers."""
        if self.compile_layers is not None:
            return self.compile_layers
        return implementation == "flex" and self._device_dtype()[0].type == "cuda"

    @contextmanager
    def _layers_compiled(self, on: bool) -> Iterator[None]:
        """Run the body with each decoder layer's `forward` replaced by its compiled version (an
        instance attribute; what was there before is put back after, also when the body raises).
        Forward hooks run outside the compiled graph."""
        if not on:
            yield
            return
        if self._compiled is None:
            self._compiled = [torch.compile(layer.forward, dynamic=False) for layer in self.layers]
        before = [layer.__dict__.get("forward") for layer in self.layers]  # e.g. an accelerate hook's wrapper
        for layer, fn in zip(self.layers, self._compiled):
            layer.forward = fn
        try:
            yield
        finally:
            for layer, fn in zip(self.layers, before):
                if fn is None:
                    del layer.forward
                else:
                    layer.forward = fn

    @torch.no_grad()  # not inference_mode: the features feed the drafter's autograd graph
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                 need_argmax: bool = True, need_last_hidden: bool = False) -> TargetOutput:
        """input_ids, position_ids [R,T] int64 (positions restart at 0 in each document).

        Returns features [R,T,k·H] (target dtype, on the target's device) and argmax [R,T] int64
        (None when need_argmax is False; then layers after max(target_layer_ids) are skipped, unless
        need_last_hidden asks for the final-normed states [R,T,H] used by the KL loss).
        One mask build per call (all rows, all layer types); no host sync on the flex path.
        """
        if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                             "must both be [R,T]")
        device, dtype = self._device_dtype()
        position_ids = position_ids.to(device=device, dtype=torch.long)
        implementation = self.implementation_for(input_ids.shape[1])
        if self.per_document:
            return self.run_per_document(input_ids, position_ids, implementation, need_argmax=need_argmax,
                                         need_last_hidden=need_last_hidden)
        with section("target_layers"):
            mask = attention_masks_for(self.config, position_ids, implementation, dtype)
        return self.run(input_ids, position_ids, mask, implementation, need_argmax=need_argmax,
                        need_last_hidden=need_last_hidden)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: Any,
            implementation: str, *, need_argmax: bool = True, need_last_hidden: bool = False) -> TargetOutput:
        """One forward with a prepared `attention_mask` under `implementation` ("flex" | "sdpa" | "eager").

        `__call__` is this with the packed-row masks. With position_ids and attention_mask None it is
        the plain HF causal forward over the whole row (documents see each other; the benchmark's
        baseline, not the packed semantics). Same outputs and layer skipping as `__call__`.
        """
        device, dtype = self._device_dtype()
        input_ids = input_ids.to(device=device, dtype=torch.long)
        R, T = input_ids.shape
        H = self.target.hidden_size
        features = torch.empty(R, T, len(self.layer_ids) * H, device=device, dtype=dtype)  # [R,T,k·H]

        def write(j: int, hidden: torch.Tensor) -> None:
            features[:, :, j * H:(j + 1) * H].copy_(hidden)

        last_hidden = self._forward(input_ids, position_ids, attention_mask, implementation, write,
                                    stop_early=not need_argmax and not need_last_hidden)
        return self._output(features, last_hidden, need_argmax, need_last_hidden)

    @torch.no_grad()
    def run_per_document(self, input_ids: torch.Tensor, position_ids: torch.Tensor, implementation: str, *,
                         need_argmax: bool = True, need_last_hidden: bool = False) -> TargetOutput:
        """The outputs of `__call__` with every document of the packed rows run as its own sequence
        (`per_document.py`: padded batches, no mask, so `implementation` is "sdpa" or "eager"). Exact
        for any causal target, stateful layers included; one host sync for the document bounds."""
        device, dtype = self._device_dtype()
        input_ids = input_ids.to(device=device, dtype=torch.long)
        position_ids = position_ids.to(device=device, dtype=torch.long)
        R, T = input_ids.shape
        H = self.target.hidden_size
        features = torch.empty(R, T, len(self.layer_ids) * H, device=device, dtype=dtype)  # [R,T,k·H]
        want_last = need_argmax or need_last_hidden
        last_hidden = torch.empty(R, T, H, device=device, dtype=dtype) if want_last else None  # [R,T,H]
        for batch in document_batches(input_ids, position_ids):
            def write(j: int, hidden: torch.Tensor, batch=batch) -> None:  # hidden [n,S,H]
                scatter(features[:, :, j * H:(j + 1) * H], batch, hidden)

            out = self._forward(batch.input_ids, batch.position_ids, None, implementation, write,
                                stop_early=not want_last)
            if last_hidden is not None:
                scatter(last_hidden, batch, out)
        return self._output(features, last_hidden, need_argmax, need_last_hidden)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: Any,
                 implementation: str, write: Any, *, stop_early: bool) -> torch.Tensor | None:
        """One base-model forward with hooks calling write(j, output of decoder layer layer_ids[j]).
        Returns the final-normed last hidden state [R,T,H], or None when `stop_early` skipped the
        layers after the last needed one."""
        last_needed = self.layer_ids[-1]

        def make_hook(j: int, layer_id: int):
            def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                write(j, output[0] if isinstance(output, (tuple, list)) else output)  # [R,T,H]
                if stop_early and layer_id == last_needed:
                    raise _StopForward
            return hook

        handles = [self.layers[i].register_forward_hook(make_hook(j, i)) for j, i in enumerate(self.layer_ids)]
        try:
            with (section("target_layers"), use_attention(self.model, implementation),
                  self._layers_compiled(self.compiles(implementation))):
                out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False)
            return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [R,T,H], normed
        except _StopForward:
            return None
        finally:
            for h in handles:
                h.remove()

    def _output(self, features: torch.Tensor, last_hidden: torch.Tensor | None, need_argmax: bool,
                need_last_hidden: bool) -> TargetOutput:
        argmax = None
        if need_argmax:
            assert last_hidden is not None
            with section("target_labels"):
                argmax = self.greedy_labels(last_hidden)
        return TargetOutput(features=features, argmax=argmax, last_hidden=last_hidden if need_last_hidden else None)

    def greedy_labels(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """last_hidden [R,T,H] (final-normed) → argmax of lm_head over V [R,T] int64.

        Chunks of `argmax_chunk` positions, so only [chunk,V] logits (in the head's dtype) exist at
        once, never [R·T,V] (fp32 at T = 8192, V = 151936 would be 5 GB); no host sync.
        """
        R, T, H = last_hidden.shape
        hidden = last_hidden.reshape(R * T, H)
        head = self.target.lm_head
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.long, device=hidden.device)
        for s in range(0, n, self.argmax_chunk):
            e = min(s + self.argmax_chunk, n)
            torch.argmax(head(hidden[s:e]), dim=-1, out=out[s:e])  # [chunk,V] logits live only here
        return out.view(R, T)
