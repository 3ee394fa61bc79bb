"""Load a drafter folder of any supported kind into (DrafterConfig, weights, metadata).

Kinds, recognized from config.json (docs/formats.md):
  checkpoint   this trainer's checkpoint (`training/checkpoint.py`): DrafterConfig fields + `dflash`
  zlab         `architectures: ["DFlashDraftModel"]` and/or a `dflash_config` block
  speculators  `speculators_model_type: "dflash"`

Used by `train --init-from DIR` (warm start / fine-tuning), by `export` (any kind → any format)
and meant for `eval --drafter DIR`.

Folders describing a drafter this trainer cannot reproduce exactly are refused with the reason:
causal attention inside the block (engines default sliding-window layers to causal unless the
config says otherwise), own embedding / LM head / reduced draft vocabulary, DFlash2 modules,
biases, non-SiLU MLPs, RoPE scaling, sampling from the anchor, an embedding scale in a speculators
folder (vLLM does not apply it). z-lab's `input_embedding_scale`, `output_multiplier` and
`final_logit_softcapping` (the target's embedding and logits functions, exported for Gemma, Granite,
Falcon-H1 targets) become embedding_scale, logit_scale and logit_softcap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.interop.formats import check_drafter_folder, declared_block_size, detect_kind
from dflash_trainer.interop.keymaps import CHAT_TEMPLATE_FILE, from_external
from dflash_trainer.target_model.layers import default_target_layer_ids
from dflash_trainer.interop.checkpoint_files import load_checkpoint

KINDS = ("checkpoint", "zlab", "speculators")

# Extras of other DFlash variants (DFlash2, MiMo, Domino, DSpark …) with the value meaning "plain
# DFlash"; any other value changes what the drafter computes.
_ZLAB_NEUTRAL: dict[str, Any] = {
    "conv_kernel_size": 0, "selector_rank": 0, "use_swa": False, "attention_sink_bias": False,
    "sample_from_anchor": False, "projector_type": "dflash",
}
_SPECULATORS_NEUTRAL: dict[str, Any] = {"sample_from_anchor": False, "shift_label": False, "projector_type": "dflash",
                                        "input_embedding_scale": 1.0}


def _head_fields(value: Any, where: str) -> dict[str, Any]:
    """DrafterConfig's embedding_scale / logit_scale / logit_softcap from z-lab's keys, read by `value(key)`
    (dflash_config first, then the top level): input_embedding_scale, output_multiplier (default 1),
    final_logit_softcapping (≤ 0 or absent = none, as z-lab's reference reads it)."""
    scale, multiplier, softcap = (value(k) for k in ("input_embedding_scale", "output_multiplier",
                                                     "final_logit_softcapping"))
    try:
        return {"embedding_scale": 1.0 if scale is None else float(scale),
                "logit_scale": 1.0 if multiplier is None else float(multiplier),
                "logit_softcap": float(softcap) if softcap is not None and float(softcap) > 0 else None}
    except (TypeError, ValueError):
        raise ValueError(f"{where}: input_embedding_scale / output_multiplier / final_logit_softcapping must be "
                         "numbers") from None


def _drafter_config(where: str, **fields: Any) -> DrafterConfig:
    try:
        return DrafterConfig(**fields)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{where}: {msgs}") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors files (single file or a sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"] if (path / "model.safetensors").is_file() else sorted(
            p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def _rope_theta(layer: dict[str, Any], where: str) -> float:
    params = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default" or (scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default")):
        raise ValueError(f"{where}: RoPE type {rope_type!r} / rope_scaling {scaling!r}: the drafter uses plain RoPE "
                         "(rope_type default); this folder cannot be reproduced")
    theta = params.get("rope_theta", layer.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: no rope_theta (nor rope_parameters.rope_theta); engines disagree on the default, "
                         "so the folder must state it")
    return float(theta)


def _check_layer(layer: dict[str, Any], where: str) -> None:
    if layer.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true; the drafter's projections have no bias")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={layer.get('hidden_act')!r}; the drafter's MLP is SiLU-gated")
    if layer.get("has_embed_tokens") or layer.get("has_lm_head"):
        raise ValueError(f"{where}: the folder has its own embedding / LM head; the drafter uses the target's")


def _common_fields(layer: dict[str, Any], where: str) -> dict[str, Any]:
    """DrafterConfig fields read from an HF Qwen3-style layer config."""
    _check_layer(layer, where)
    heads = int(layer["num_attention_heads"])
    hidden = int(layer["hidden_size"])
    n = int(layer["num_hidden_layers"])
    # HF Qwen3Config's own default when layer_types is absent: layers ≥ max_window_layers slide.
    max_window = int(layer.get("max_window_layers", 28))
    layer_types = layer.get("layer_types") or [
        "sliding_attention" if layer.get("use_sliding_window") and i >= max_window else "full_attention"
        for i in range(n)]
    sliding = "sliding_attention" in layer_types
    return {
        "hidden_size": hidden,
        "intermediate_size": int(layer["intermediate_size"]),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(layer, where),
        "vocab_size": int(layer["vocab_size"]),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 32768)),
        "layer_types": list(layer_types),
        "sliding_window": int(layer["sliding_window"]) if sliding and layer.get("sliding_window") else None,
    }


def _num_target_layers(body: dict[str, Any], given: int | None, where: str) -> int:
    block = body.get("dflash_trainer") or {}
    n = body.get("num_target_layers", (body.get("dflash_config") or {}).get("num_target_layers",
                                                                           block.get("num_target_layers")))
    if n is None:
        n = given
    elif given is not None and int(n) != int(given):
        raise ValueError(f"{where}: num_target_layers={n} but the target has {given} decoder layers; "
                         "this drafter was trained for another target")
    if n is None:
        raise ValueError(f"{where}: the folder does not say how many layers the target has; pass num_target_layers "
                         "(train --init-from does, from the loaded target)")
    return int(n)


def zlab_drafter_config(body: dict[str, Any], *, num_target_layers: int | None = None,
                        where: str = "config.json") -> DrafterConfig:
    """DrafterConfig from a zlab-format config.json. Raises ValueError for unsupported drafters."""
    archs = body.get("architectures") or []
    if archs and "DFlashDraftModel" not in archs:
        raise ValueError(f"{where}: architectures={archs}; only DFlashDraftModel drafters can be imported "
                         "(DFlash2 adds modules this trainer does not have)")
    dflash = dict(body.get("dflash_config") or {})
    for key, neutral in _ZLAB_NEUTRAL.items():
        value = dflash.get(key, body.get(key))
        if value is not None and value != neutral:
            raise ValueError(f"{where}: dflash_config.{key}={value!r} is not supported (plain DFlash has {neutral!r})")
    fields = _common_fields(body, where)
    swa = dflash.get("swa_window_size")
    if swa is not None and int(swa) != fields["sliding_window"]:
        raise ValueError(f"{where}: dflash_config.swa_window_size={swa} differs from sliding_window="
                         f"{fields['sliding_window']}; vLLM would use swa_window_size")
    is_causal = body.get("is_causal", dflash.get("causal"))
    if is_causal:
        raise ValueError(f"{where}: is_causal=true (causal attention inside the block); this drafter attends "
                         "bidirectionally within a block")
    if is_causal is None and "sliding_attention" in fields["layer_types"]:
        raise ValueError(f"{where}: sliding_attention layers without `is_causal: false`: current vLLM, SGLang and "
                         "z-lab code run those layers causally within the block, which this drafter (bidirectional "
                         "blocks) cannot reproduce; if the folder was trained with bidirectional blocks, add "
                         "\"is_causal\": false to its config.json")
    n_target = _num_target_layers(body, num_target_layers, where)
    ids = dflash.get("target_layer_ids", body.get("target_layer_ids"))
    if ids is None:  # the reference code's fallback: one target layer per drafter layer
        ids = default_target_layer_ids(n_target, fields["num_hidden_layers"])
    mask = dflash.get("mask_token_id", body.get("mask_token_id"))
    if mask is None:
        raise ValueError(f"{where}: no dflash_config.mask_token_id; the mask token must be known to reproduce serving")
    head = _head_fields(lambda key: dflash.get(key, body.get(key)), where)
    return _drafter_config(where, **fields, **head, block_size=declared_block_size(body, "zlab"), mask_token_id=int(mask),
                           target_layer_ids=[int(i) for i in ids], num_target_layers=n_target)


def speculators_drafter_config(body: dict[str, Any], *, num_target_layers: int | None = None,
                               where: str = "config.json") -> DrafterConfig:
    """DrafterConfig from a speculators-format config.json. Raises ValueError for unsupported drafters."""
    if body.get("speculators_model_type") != "dflash":
        raise ValueError(f"{where}: speculators_model_type={body.get('speculators_model_type')!r}; only 'dflash' "
                         "drafters can be imported")
    layer = dict(body.get("transformer_layer_config") or {})
    if not layer:
        raise ValueError(f"{where}: no transformer_layer_config")
    fields = _common_fields(layer, f"{where} transformer_layer_config")
    for key, neutral in _SPECULATORS_NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral:
            raise ValueError(f"{where}: {key}={value!r} is not supported (plain DFlash has {neutral!r})")
    if int(body.get("draft_vocab_size") or fields["vocab_size"]) != fields["vocab_size"]:
        raise ValueError(f"{where}: draft_vocab_size={body['draft_vocab_size']} differs from vocab_size="
                         f"{fields['vocab_size']}; reduced draft vocabularies are not supported")
    # vLLM reads a missing key as non-causal (dflash_config.causal = not get(..., True)).
    if "sliding_attention" in fields["layer_types"] and not body.get("sliding_window_non_causal", True):
        raise ValueError(f"{where}: sliding_window_non_causal=false (sliding layers causal within the block); "
                         "this drafter attends bidirectionally within a block")
    if layer.get("is_causal"):
        raise ValueError(f"{where}: transformer_layer_config.is_causal=true; this drafter attends bidirectionally "
                         "within a block")
    aux = body.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{where}: no aux_hidden_state_layer_ids")
    if min(int(i) for i in aux) < 1:
        raise ValueError(f"{where}: aux_hidden_state_layer_ids={aux} contains 0, the embedding output, which "
                         "no DFlash target layer id maps to")
    if body.get("mask_token_id") is None:
        raise ValueError(f"{where}: no mask_token_id")
    return _drafter_config(where, **fields, **_head_fields(body.get, where),
                           block_size=declared_block_size(body, "speculators"),
                           mask_token_id=int(body["mask_token_id"]), target_layer_ids=[int(i) - 1 for i in aux],
                           num_target_layers=_num_target_layers(body, num_target_layers, where))


def _external_metadata(path: Path, body: dict[str, Any], kind: str) -> dict[str, Any]:
    block = body.get("dflash_trainer") or {}
    template_file = path / CHAT_TEMPLATE_FILE
    verifier = ((body.get("speculators_config") or {}).get("verifier") or {})
    return {
        "target": block.get("target", verifier.get("name_or_path")),
        "verifier_architectures": verifier.get("architectures"),
        "chat_template": template_file.read_text() if template_file.is_file() else None,
        "enable_thinking": block.get("enable_thinking"),
        "mask_token": (body.get("dflash_config") or {}).get("mask_token"),
        "mask_token_reason": block.get("mask_token_reason") or f"from {kind} folder {path}",
        "step": block.get("step"),
    }


def load_drafter(path: str | Path, *, num_target_layers: int | None = None
                 ) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Read a checkpoint, zlab or speculators folder.

    Returns (config, weights under our drafter names, metadata). metadata always has `kind`,
    `source`, `target`, `chat_template`, `enable_thinking`, `mask_token_reason`, `step` (None when
    the folder does not say). num_target_layers: the target's decoder-layer count, needed for
    speculators folders not written by this trainer; when given it must match the folder.
    Raises ValueError naming the folder and the reason for anything it cannot load faithfully.
    """
    path = Path(path)
    cfg_file = check_drafter_folder(path)
    body = json.loads(cfg_file.read_text())
    kind = detect_kind(body)
    where = str(cfg_file)
    if kind == "checkpoint":
        dc, weights, meta = load_checkpoint(path)
        if num_target_layers is not None and dc.num_target_layers != num_target_layers:
            raise ValueError(f"{where}: num_target_layers={dc.num_target_layers} but the target has "
                             f"{num_target_layers} decoder layers")
        return dc, weights, {**meta, "kind": kind, "source": str(path)}
    if kind == "zlab":
        dc = zlab_drafter_config(body, num_target_layers=num_target_layers, where=where)
    else:
        dc = speculators_drafter_config(body, num_target_layers=num_target_layers, where=where)
    weights = from_external(read_weights(path), kind, dc.num_hidden_layers)
    return dc, weights, {**_external_metadata(path, body, kind), "kind": kind, "source": str(path)}
