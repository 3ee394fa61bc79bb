"""What a target family needs from the trainer, read from the model's structure (no weights needed).

The features of a packed row must equal the target's own forward of each document alone
(docs/targets.md). Four facts decide how the frozen target runs, all read from the model object
(the real one at `train`, or one built on the meta device from the HF config at `init-config`):

  1. Layers that carry state across positions (gated-delta-net linear attention, Mamba mixers,
     short convolutions): one forward over a packed row would carry the state of one document into
     the next, whatever the attention mask says. Such targets run ONE FORWARD PER DOCUMENT
     (`per_document.py`); rows stay packed for the drafter. Found from `config.layer_types` entries
     other than full/sliding attention, or a decoder layer holding an `nn.Conv1d` or a module whose
     class name names a recurrent mixer (`_STATEFUL_NAMES`).
  2. Attention paths (`attention.py`): sdpa needs the class's own `_supports_sdpa` (transformers sets
     it False for gpt-oss's attention sinks and Gemma 2's logit soft-capping, which SDPA cannot
     express), no attention-sink parameters and no `attn_logit_softcapping`; flex needs
     `_supports_flex_attn`, and sinks need CUDA there (transformers renormalizes with the
     log-sum-exp, which its CPU flex path does not return); eager (transformers' own math with an
     additive mask) runs every family.
  3. Transforms around the embedding and the LM head (Gemma's √H, Granite's and Falcon-H1's
     multipliers, final soft-capping; `head_transforms.py`): the drafter applies the target's own
     (target_model/shared_head.py), so its block input, its logits and the KL teacher are the target's.
     Monotone when positive, so the greedy labels (argmax of the plain head) are unchanged; a
     non-positive logit scale or soft-cap would reorder the argmax: refused.
  4. Structure: a causal-LM class transformers maps the config to, a decoder stack with a `layers`
     list, an `nn.Embedding` input and an `nn.Linear` head. Missing → refused at init-config and at
     train start with one line (architecture, missing piece, way out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dflash_trainer.target_model.head_transforms import TargetHead, target_head
from dflash_trainer.target_model.load import find_decoder_layers

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Class-name fragments (CamelCase, case-sensitive) of mixers that carry state across positions.
_STATEFUL_NAMES = ("Mamba", "DeltaNet", "LinearAttention", "ShortConv", "Recurrent", "Rwkv", "RWKV", "Ssm", "SSM")
# Config fields that transform the logits after the LM head; a non-positive value reorders the argmax.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_scaling", "lm_head_multiplier")


@dataclass(frozen=True)
class TargetSupport:
    """The trainer's verdict on one target architecture.

    architecture: model class name ("GptOssForCausalLM"); model_type: config.model_type.
    stateful: None, or what carries state across positions ("linear_attention layers
    (Qwen3NextGatedDeltaNet)") or what the document masks do not cover (layer kinds other than
    full / sliding attention, no mixer found); then `per_document` is True: one forward per document.
    unsupported: {path: why not} for the attention paths "sdpa" / "flex" that cannot give exact
    features on any device; `flex_on_cpu` is why flex cannot run on the CPU (sinks) or None.
    sinks / softcap: the attention needs sink logits / tanh soft-capping of the scores.
    head: what the target applies around its embedding and LM head (`head_transforms.TargetHead`),
    which the drafter applies too.
    needs: what else the family needed, one short phrase each (docs/targets.md, init-config).
    refused: None, or the one line why this target cannot be trained (architecture, missing piece,
    way out).
    """

    architecture: str
    model_type: str
    stateful: str | None = None
    unsupported: dict[str, str] = field(default_factory=dict)
    flex_on_cpu: str | None = None
    sinks: bool = False
    softcap: float | None = None
    head: TargetHead = field(default_factory=TargetHead)
    needs: tuple[str, ...] = ()
    refused: str | None = None

    @property
    def per_document(self) -> bool:
        """True when the target runs one forward per document (stateful layers)."""
        return self.stateful is not None

    @property
    def dense_path(self) -> str:
        """The dense-mask path that gives exact features here: "sdpa", else "eager"."""
        return "eager" if "sdpa" in self.unsupported else "sdpa"

    def flex_reason(self, device: torch.device) -> str | None:
        """Why flex cannot give exact features on `device` (None = it can)."""
        if "flex" in self.unsupported:
            return self.unsupported["flex"]
        return self.flex_on_cpu if device.type != "cuda" else None

    @property
    def _why_split(self) -> str:
        if "(" in (self.stateful or ""):  # a mixer class was found: state or a convolution window
            return "which carry state across positions"
        return "which the document masks do not cover"

    def summary(self) -> list[str]:
        """`forward_line()` and then `needs`: what init-config prints about the target family."""
        return [self.forward_line(), *self.needs]

    def forward_line(self) -> str:
        """One log line: how the target forward treats packed rows, and why."""
        if self.per_document:
            return (f"one target forward per document ({self.architecture} has {self.stateful}, {self._why_split}); "
                    "rows stay packed for the drafter")
        return "one target forward per packed row, each document masked off from the others"


def _config_text(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _stateful_layers(layers: nn.ModuleList, cfg: Any) -> str | None:
    """What in the decoder layers carries state across positions, or None (attention-only layers).

    Named by the `layer_types` kinds that are not attention and by the mixer classes: the module
    holding an `nn.Conv1d` (a causal convolution over positions), or one whose class name holds a
    fragment of `_STATEFUL_NAMES`."""
    kinds = [k for k in dict.fromkeys(getattr(cfg, "layer_types", None) or []) if k not in ATTENTION_LAYER_TYPES]
    mixers: list[str] = []
    for layer in layers:
        modules = dict(layer.named_modules())
        for name, module in modules.items():
            if isinstance(module, nn.Conv1d):
                module = modules.get(name.rpartition(".")[0], module)  # the mixer that owns the convolution
            elif not any(s in type(module).__name__ for s in _STATEFUL_NAMES):
                continue
            if type(module).__name__ not in mixers:
                mixers.append(type(module).__name__)
    if not kinds and not mixers:
        return None
    what = f"{'/'.join(kinds)} layers" if kinds else "layers"
    return f"{what} ({', '.join(mixers)})" if mixers else what


def _logit_transform_refusal(cfg: Any, architecture: str) -> str | None:
    """The refusal line for a non-positive logit transform (it would reorder the argmax), or None."""
    for name in _LOGIT_TRANSFORMS:
        value = getattr(cfg, name, None)
        if isinstance(value, (int, float)) and value <= 0:
            return (f"{architecture}: {name}={value} reverses or erases the order of the logits, so the greedy "
                    "labels would not be the target's argmax; this target cannot be trained here (use a "
                    "checkpoint with a positive value)")
    return None


def target_support(model: nn.Module) -> TargetSupport:
    """The trainer's verdict on a causal LM (real weights or built on the meta device).

    Never raises for an unsupported model: `refused` carries the one line. Reads class flags
    (`_supports_sdpa`, `_supports_flex_attn`), config fields and module structure only.
    """
    architecture = type(model).__name__
    cfg = _config_text(model)
    model_type = str(getattr(cfg, "model_type", "") or getattr(model.config, "model_type", ""))
    try:
        layers = find_decoder_layers(model)
    except ValueError as e:
        why = str(e).removeprefix(architecture + ": ")
        return TargetSupport(architecture, model_type, refused=f"{architecture}: {why}; the features are read from the "
                             "decoder layers `layers[ℓ]`, so this architecture cannot be a target")
    if not isinstance(model.get_input_embeddings(), nn.Embedding) or not isinstance(model.get_output_embeddings(),
                                                                                  nn.Linear):
        return TargetSupport(architecture, model_type, refused=f"{architecture}: the input embedding must be an "
                             "nn.Embedding and the output head an nn.Linear (the drafter shares both); this "
                             "architecture cannot be a target")
    needs: list[str] = []
    unsupported: dict[str, str] = {}
    stateful = _stateful_layers(layers, cfg)
    if stateful:
        unsupported["flex"] = f"{architecture} runs one forward per document ({stateful}), without a document mask"
    sinks = any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in layers.modules())
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if sinks:
        needs.append("attention sinks: eager on CPU, flex on CUDA, never sdpa")
        unsupported["sdpa"] = (f"{architecture} has attention sinks, which transformers' SDPA attention drops "
                               "(the features would be wrong)")
    if softcap is not None:
        needs.append(f"attention logit soft-capping {softcap}: eager or flex, never sdpa")
        unsupported.setdefault("sdpa", f"{architecture} soft-caps its attention logits "
                                       f"(attn_logit_softcapping={softcap}), which SDPA cannot do")
    if not getattr(type(model), "_supports_sdpa", True):
        unsupported.setdefault("sdpa", f"transformers does not run {architecture} with SDPA")
    if not getattr(type(model), "_supports_flex_attn", False):
        unsupported.setdefault("flex", f"transformers does not run {architecture} with flex attention")
    flex_on_cpu = (f"{architecture} has attention sinks, which transformers' flex attention applies on CUDA only"
                   if sinks else None)
    refusal = _logit_transform_refusal(cfg, architecture)
    head = target_head(model)
    if head.what:
        needs.append(f"{', '.join(head.what)}: the drafter's block embedding and logits apply the same")
    layer_types = set(getattr(cfg, "layer_types", None) or [])
    if "sliding_attention" in layer_types or (not layer_types and getattr(cfg, "sliding_window", None)
                                               and getattr(cfg, "use_sliding_window", True) is not False):
        needs.append(f"sliding window {cfg.sliding_window} in the document mask")
    return TargetSupport(architecture, model_type, stateful=stateful, unsupported=unsupported,
                         flex_on_cpu=flex_on_cpu, sinks=sinks, softcap=softcap, head=head,
                         needs=tuple(needs), refused=refusal)


def support_from_config(hf_config: Any) -> TargetSupport:
    """`target_support` of the causal LM transformers builds from `hf_config`, built on the meta
    device (no memory, no weights; well under a second for an 8B config). A config transformers has
    no causal-LM class for, or cannot build one from, is refused (`refused` set), never raised."""
    from transformers import AutoModelForCausalLM

    model_type = str(getattr(hf_config, "model_type", "?"))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as e:  # noqa: BLE001 — whatever transformers raises, `train` could not load it either
        return TargetSupport(type(hf_config).__name__, model_type,
                             refused=f"model_type {model_type!r}: transformers builds no causal LM from this config "
                                     f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}); the target "
                                     "must be a decoder-only causal LM transformers can build")
    return target_support(model)


def check_supported(support: TargetSupport) -> TargetSupport:
    """`support` itself; ValueError with its one-line reason when the target is refused."""
    if support.refused:
        raise ValueError(support.refused)
    return support
