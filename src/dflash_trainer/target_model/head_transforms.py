"""What a target does around its embedding and LM head, read from the model, and checked by running it.

The drafter shares the target's embedding and LM head and must apply the target's own functions
around them (target_model/shared_head.py). transformers 5.24 puts them in three places:

  in the embedding module   Gemma 2 / Gemma 3 (`Gemma{2,3}TextScaledWordEmbedding`): rows × √H, the
                            scale held as `scalar_embed_scale` and rounded to the weight's dtype
  in the model's forward    Granite: `inputs_embeds * embedding_multiplier` (whatever made them);
                            Falcon-H1: `embed_tokens(input_ids) * embedding_multiplier`
  after the LM head         Granite: `/ logits_scaling`; Falcon-H1: `* lm_head_multiplier`;
                            Gemma 2 / 3: `final_logit_softcapping` c: c·tanh(z/c)

`target_head(model)` reads these (the real model at train / eval, one built on the meta device at
init-config); `check_target_head(bundle, head)` runs the target once on a few tokens and compares
what its first decoder layer receives and what it returns as logits with the drafter's functions
(hooks on layer 0's input and on the LM head), so a family that transforms them some other way is
refused with one line instead of training a drafter on another function than the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_trainer.target_model.shared_head import embed_block, transform_logits

# Relative error ‖drafter − target‖ / ‖target‖ accepted by the run-time check, per dtype: fp32 is
# exact on every family of docs/targets.md; 16-bit dtypes round Gemma's √H to the dtype first.
_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
_LOW_PRECISION_TOLERANCE = 2e-2


@dataclass(frozen=True)
class TargetHead:
    """The target's functions around its embedding and LM head (drafter config fields of the same names).

    embedding_scale: factor on the embedding rows before the first layer. logit_scale: factor on the
    LM head's output. logit_softcap: c of the final c·tanh(z/c), or None. what: one phrase per
    transform found (for init-config and docs), empty when the target is a plain lookup and matmul.
    """

    embedding_scale: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    what: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        """{embedding_scale, logit_scale, logit_softcap}: the DrafterConfig fields."""
        return {"embedding_scale": self.embedding_scale, "logit_scale": self.logit_scale,
                "logit_softcap": self.logit_softcap}


def _text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _positive(value: Any) -> float | None:
    """value as a float when it is a positive number (None, 0 and negatives are not a transform here;
    families.py refuses the non-positive ones)."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def target_head(model: nn.Module) -> TargetHead:
    """Read the target's transforms from its embedding module and config (no forward, no weights)."""
    cfg = _text_config(model)
    what: list[str] = []
    scale = 1.0
    module = model.get_input_embeddings()
    module_scale = _positive(getattr(module, "scalar_embed_scale", None))
    if module_scale is not None and module_scale != 1.0:
        scale *= module_scale
        what.append(f"embedding rows × {module_scale:g} ({type(module).__name__})")
    multiplier = _positive(getattr(cfg, "embedding_multiplier", None))
    if multiplier is not None and multiplier != 1.0:
        scale *= multiplier
        what.append(f"embedding rows × embedding_multiplier {multiplier:g}")
    logit_scale = 1.0
    divisor = _positive(getattr(cfg, "logits_scaling", None))
    if divisor is not None and divisor != 1.0:
        logit_scale /= divisor
        what.append(f"logits ÷ logits_scaling {divisor:g}")
    head_multiplier = _positive(getattr(cfg, "lm_head_multiplier", None))
    if head_multiplier is not None and head_multiplier != 1.0:
        logit_scale *= head_multiplier
        what.append(f"logits × lm_head_multiplier {head_multiplier:g}")
    softcap = _positive(getattr(cfg, "final_logit_softcapping", None))
    if softcap is not None:
        what.append(f"logits soft-capped at final_logit_softcapping {softcap:g}")
    return TargetHead(scale, logit_scale, softcap, tuple(what))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))  # host sync: a one-off check


@torch.no_grad()
def check_target_head(target: Any, head: TargetHead, *, num_tokens: int = 8) -> None:
    """Run the target once and raise ValueError (one line) when `head` does not reproduce it.

    target: a TargetBundle (model, embed_tokens, lm_head, vocabulary). Tokens spread over the
    vocabulary; compared: the input of decoder layer 0 with embed_block(ids), and the model's logits
    with transform_logits(lm_head(its input)). Tolerance: relative 1e-5 in fp32, 2e-2 in 16-bit dtypes.
    """
    from dflash_trainer.target_model.load import find_decoder_layers

    model = target.model
    weight = target.embed_tokens.weight
    device = weight.device
    ids = torch.linspace(0, target.vocab_size - 1, num_tokens, device=device).long()[None]  # [1,n]
    seen: dict[str, torch.Tensor] = {}

    def layer_input(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    def head_io(_m: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["h"], seen["z"] = args[0].detach().clone(), output.detach().clone()

    handles = [find_decoder_layers(model)[0].register_forward_pre_hook(layer_input, with_kwargs=True),
               target.lm_head.register_forward_hook(head_io)]
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    tol = _TOLERANCE.get(weight.dtype, _LOW_PRECISION_TOLERANCE)
    name = type(model).__name__
    embed_err = _relative_error(embed_block(ids, weight, head.embedding_scale), seen["x"])
    if embed_err > tol:
        raise ValueError(f"{name}: its first layer does not receive embedding_scale={head.embedding_scale:g} × the "
                         f"embedding rows (relative difference {embed_err:.2g}); the drafter could not embed its "
                         "block as the target does, so this architecture cannot be a target here")
    want = logits.float().reshape(-1, logits.shape[-1])
    got = transform_logits(seen["z"].float(), head.logit_scale, head.logit_softcap).reshape(want.shape)
    logit_err = _relative_error(got, want)
    if logit_err > tol:
        raise ValueError(f"{name}: its logits are not the LM head's output × logit_scale={head.logit_scale:g} "
                         f"soft-capped at {head.logit_softcap} (relative difference {logit_err:.2g}); the drafter "
                         "could not use the target's logits function, so this architecture cannot be a target here")


def check_drafter_head(dc: Any, head: TargetHead, where: str, fix: str) -> None:
    """ValueError starting with `where` when the drafter config's embedding_scale / logit_scale /
    logit_softcap differ from the target's (`head`): the drafter would embed its block or score its
    drafts with another function than the target it is trained or evaluated with."""
    diffs = [f"{k}={getattr(dc, k)} (the target's: {v})" for k, v in head.fields().items() if getattr(dc, k) != v]
    if diffs:
        raise ValueError(f"{where}: {', '.join(diffs)}; the drafter must use the target's own embedding and logits "
                         f"functions; {fix}")
