"""Weight-name tables between this trainer's drafter and the serving formats (docs/formats.md).

One explicit table per external format: our parameter name → the tensor name in that format's
`model.safetensors`. `{i}` stands for the decoder-layer index (0 … num_hidden_layers − 1).
Both formats store the drafter's own weights only (no embedding, no LM head: serving engines take
them from the target), and both use the HF-Qwen3 layout without a `model.` prefix, so today both
tables are identities. They are kept separate because the formats evolve independently; a renamed
tensor is a one-line change in one table, covered by the round-trip tests.

Where the names come from (read in the engines' loaders, see docs/formats.md):
  zlab        z-lab/dflash `dflash/model.py` (DFlashDraftModel module tree); SGLang
              `python/sglang/srt/models/dflash.py` (load_weights stacks q/k/v and gate/up by
              these names); vLLM `vllm/model_executor/models/qwen3_dflash.py` (prefixes `model.`)
  speculators vllm-project/speculators `src/speculators/models/dflash/core.py` (same module
              names; `embed_tokens`, `lm_head` (full vocabulary), `verifier_*`, `t2d`/`d2t` are not
              saved or are ignored on load); vLLM loads it with the same model class as zlab
"""

from __future__ import annotations

import re

import torch

# --- z-lab / SGLang / HF trust_remote_code format ---------------------------------------------
ZLAB_WEIGHTS: dict[str, str] = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "norm.weight": "norm.weight",
    "layers.{i}.input_layernorm.weight": "layers.{i}.input_layernorm.weight",
    "layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.self_attn.q_proj.weight": "layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.self_attn.k_proj.weight": "layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.v_proj.weight": "layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.o_proj.weight": "layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.self_attn.q_norm.weight": "layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
}

# --- vLLM speculators format: the same names as the zlab format ------------------------------
SPECULATORS_WEIGHTS: dict[str, str] = dict(ZLAB_WEIGHTS)

WEIGHT_TABLES: dict[str, dict[str, str]] = {"zlab": ZLAB_WEIGHTS, "speculators": SPECULATORS_WEIGHTS}

# Written next to config.json and model.safetensors in an exported folder (both formats).
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the template the training data was rendered with

# Tensors some published folders carry that this drafter cannot represent. Importing such a
# folder would silently change what the drafter computes, so they are refused by name.
_UNSUPPORTED_HINTS = {
    "embed_tokens": "an own token embedding (the drafter uses the target's)",
    "lm_head": "an own LM head (a reduced draft vocabulary)",
    "d2t": "a draft→target vocabulary map (reduced draft vocabulary)",
    "t2d": "a target→draft vocabulary map (reduced draft vocabulary)",
    "candidate_selector": "a DFlash2 candidate selector",
    "attention_conv": "DFlash2 grouped convolutions",
    "mlp_conv": "DFlash2 grouped convolutions",
    "bias": "linear biases (attention_bias)",
    "attention_sink_bias": "attention sink biases",
    "mask_embedding": "a separate mask embedding",
}


def expand_table(table: dict[str, str], num_layers: int) -> dict[str, str]:
    """The table with `{i}` expanded for layers 0 … num_layers − 1: {our name: external name}."""
    out: dict[str, str] = {}
    for ours, theirs in table.items():
        if "{i}" in ours:
            for i in range(num_layers):
                out[ours.format(i=i)] = theirs.format(i=i)
        else:
            out[ours] = theirs
    return out


def to_external(weights: dict[str, torch.Tensor], fmt: str, num_layers: int) -> dict[str, torch.Tensor]:
    """Rename our drafter weights to `fmt`'s names. Exactly the table's keys must be present.

    Raises ValueError listing missing or unexpected names (a drafter of another shape, or an
    embedding/LM head that must never be exported).
    """
    names = expand_table(WEIGHT_TABLES[fmt], num_layers)
    missing, unexpected = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
    if missing or unexpected:
        raise ValueError(f"export to {fmt}: drafter weights do not match the {fmt} table for {num_layers} layers: "
                         f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    return {names[k]: v for k, v in weights.items()}


def _hint(name: str) -> str:
    for key, what in _UNSUPPORTED_HINTS.items():
        if re.search(rf"(^|\.){key}(\.|$)", name) or name.endswith("." + key):
            return f" ({name}: {what})"
    return ""


def from_external(weights: dict[str, torch.Tensor], fmt: str, num_layers: int) -> dict[str, torch.Tensor]:
    """Rename a `fmt` folder's tensors to our drafter names (inverse of `to_external`).

    A leading `model.` on every name is accepted (some tools save with it; SGLang and vLLM strip
    it). Raises ValueError listing missing tensors, and unexpected ones with what they are when
    known (own embedding/LM head, DFlash2 modules, biases): such folders hold a drafter this
    trainer cannot represent.
    """
    if weights and all(k.startswith("model.") for k in weights):
        weights = {k[len("model."):]: v for k, v in weights.items()}
    inverse = {theirs: ours for ours, theirs in expand_table(WEIGHT_TABLES[fmt], num_layers).items()}
    missing, unexpected = sorted(set(inverse) - set(weights)), sorted(set(weights) - set(inverse))
    if unexpected:
        hints = "".join(_hint(n) for n in unexpected[:6])
        raise ValueError(f"{fmt} folder holds tensors this drafter cannot represent: {unexpected[:6]}{hints}; "
                         "only the DFlash drafter of docs/formats.md can be imported")
    if missing:
        raise ValueError(f"{fmt} folder lacks tensors for a {num_layers}-layer drafter: {missing[:6]}; "
                         "does num_hidden_layers in config.json match model.safetensors?")
    return {inverse[k]: v for k, v in weights.items()}
