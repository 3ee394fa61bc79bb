"""Export a drafter to the folders serving engines load (docs/formats.md has every field).

  zlab         z-lab/dflash reference code, SGLang (`--speculative-algorithm DFLASH`) and vLLM
               (`"method": "dflash"`): a Qwen3-style config.json with `architectures:
               ["DFlashDraftModel"]` and a `dflash_config` block.
  speculators  vLLM's speculators format: `speculators_model_type: "dflash"`, the layer config
               nested in `transformer_layer_config`, target layers as `aux_hidden_state_layer_ids`.

Both folders hold `config.json`, `model.safetensors` (drafter weights only: the embedding and LM
head are the target's) and, when known, `chat_template.jinja` (the template the training data
was rendered with). A `dflash_trainer` block in config.json records the target (by the portable
name of interop/verifier.py, never a path of the training machine), the template's sha256, the
thinking flag and the mask-token choice; engines ignore unknown keys. `export` also writes
`speculation.json` (interop/speculation.py): the draft length to serve per batch size when an
eval's speedup table is given, else only the maximum B−1; no engine reads it.

Conventions that differ between formats (checked against the loaders, docs/formats.md):
  * target layers: zlab stores our ids ℓ (output of decoder layer ℓ = HF hidden_states[ℓ+1]);
    speculators stores the residual stream *entering* a layer (EAGLE capture ids), i.e. ℓ + 1.
  * in-block attention: this drafter is bidirectional inside a block on every layer. Engines
    default sliding-window layers to causal, so zlab writes `is_causal: false` and speculators
    writes `sliding_window_non_causal: true` (and `is_causal: false` in the layer config).
  * the target's embedding and logits functions (embedding_scale, logit_scale, logit_softcap; Gemma,
    Granite, Falcon-H1): zlab writes z-lab's `dflash_config.input_embedding_scale`,
    `output_multiplier` and `final_logit_softcapping` (its reference drafter reads all three);
    speculators writes the two logit keys and refuses an embedding scale (vLLM's DFlash drafter
    embeds the block with the target's raw rows and reads no scale). Neutral values are not written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.shape import mask_token_text
from dflash_trainer.interop.fingerprint import weights_fingerprint
from dflash_trainer.interop.formats import DTYPE_NAMES, check_format
from dflash_trainer.files.writable import check_creatable
from dflash_trainer.interop.keymaps import CHAT_TEMPLATE_FILE, to_external
from dflash_trainer.interop.load_drafter import load_drafter
from dflash_trainer.interop.speculation import SPECULATION_FILE, read_speedup_eval, speculation_sidecar

FORMAT_VERSION = 1
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_config(dc: DrafterConfig, dtype_name: str | None) -> dict[str, Any]:
    """The HF Qwen3 fields of the drafter (shared by both formats)."""
    sliding = "sliding_attention" in dc.layer_types
    body: dict[str, Any] = {
        "model_type": "qwen3",
        "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size,
        "num_hidden_layers": dc.num_hidden_layers,
        "num_attention_heads": dc.num_attention_heads,
        "num_key_value_heads": dc.num_key_value_heads,
        "head_dim": dc.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": dc.rms_norm_eps,
        # transformers 4.x reads rope_theta, 5.x rope_parameters; vLLM defaults a missing base to 1e6.
        "rope_theta": dc.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dc.rope_theta},
        "vocab_size": dc.vocab_size,
        "max_position_embeddings": dc.max_position_embeddings,
        "tie_word_embeddings": False,
        "use_cache": False,
        "layer_types": list(dc.layer_types),
        # HF Qwen3Config drops sliding_window unless use_sliding_window is true.
        "sliding_window": dc.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "max_window_layers": dc.num_hidden_layers,
        "is_causal": False,
    }
    if dtype_name is not None:
        body["dtype"] = dtype_name
    return body


def head_keys(dc: DrafterConfig, *, embedding: bool = True) -> dict[str, float]:
    """z-lab's names for the drafter's non-neutral embedding / logits functions: input_embedding_scale
    (embedding=False leaves it out), output_multiplier, final_logit_softcapping."""
    keys: dict[str, float] = {}
    if embedding and dc.embedding_scale != 1.0:
        keys["input_embedding_scale"] = dc.embedding_scale
    if dc.logit_scale != 1.0:
        keys["output_multiplier"] = dc.logit_scale
    if dc.logit_softcap is not None:
        keys["final_logit_softcapping"] = dc.logit_softcap
    return keys


def check_speculators_head(dc: DrafterConfig) -> None:
    """ValueError (one line) for a drafter the speculators format cannot carry: an embedding scale."""
    if dc.embedding_scale != 1.0:
        raise ValueError(f"--format speculators: this drafter embeds its block as {dc.embedding_scale:g} × the target's "
                         "embedding rows (embedding_scale, as its target does); vLLM's DFlash drafter embeds raw rows "
                         "and reads no scale, so it would run another drafter; export --format zlab (z-lab's reference "
                         "reads dflash_config.input_embedding_scale)")


# What serving a zlab folder with an embedding scale needs (docs/formats.md, "Embedding and logits").
ZLAB_SCALE_NOTE = ("dflash_config.input_embedding_scale={scale:g}: z-lab's reference drafter applies it; vLLM's and "
                   "SGLang's DFlash drafters embed the block without it (SGLang keeps Gemma 3's own √H), so serve this "
                   "folder with z-lab's reference, or expect lower acceptance (never wrong output) elsewhere")


def trainer_block(dc: DrafterConfig, meta: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """The `dflash_trainer` block: what serving must reproduce (template, thinking flag, mask)."""
    return {
        "format_version": FORMAT_VERSION,
        "target": meta.get("target"),
        "num_target_layers": dc.num_target_layers,
        "chat_template_file": CHAT_TEMPLATE_FILE if chat_template else None,
        "chat_template_sha256": hashlib.sha256(chat_template.encode()).hexdigest() if chat_template else None,
        "enable_thinking": meta.get("enable_thinking"),
        "mask_token_reason": meta.get("mask_token_reason"),
        "step": meta.get("step"),
    }


def zlab_config(dc: DrafterConfig, meta: dict[str, Any], *, dtype_name: str | None = None,
                mask_token: str | None = None) -> dict[str, Any]:
    """config.json of the zlab format (z-lab reference code, SGLang, vLLM).

    mask_token: the tokenizer's string for `mask_token_id` when it is a tokenizer entry. SGLang
    checks `dflash_config.mask_token` (default "<|MASK|>") against the tokenizer, so it is written
    whenever known.
    """
    dflash: dict[str, Any] = {"block_size": dc.block_size, "mask_token_id": dc.mask_token_id,
                              "target_layer_ids": list(dc.target_layer_ids), **head_keys(dc)}
    if mask_token is not None:
        dflash["mask_token"] = mask_token
    return {
        "architectures": ["DFlashDraftModel"],
        **_layer_config(dc, dtype_name),
        "block_size": dc.block_size,  # read at top level by older reference code
        "num_target_layers": dc.num_target_layers,
        "dflash_config": dflash,
        "dflash_trainer": trainer_block(dc, meta, meta.get("chat_template")),
    }


def speculators_config(dc: DrafterConfig, meta: dict[str, Any], *, dtype_name: str | None = None,
                       verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    """config.json of vLLM's speculators format (speculators_model_type "dflash"). ValueError for a
    drafter with an embedding scale (`check_speculators_head`)."""
    check_speculators_head(dc)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": _layer_config(dc, None),
        "draft_vocab_size": dc.vocab_size,
        "block_size": dc.block_size,
        # EAGLE capture ids: the residual stream entering layer ℓ+1 = output of layer ℓ.
        "aux_hidden_state_layer_ids": [i + 1 for i in dc.target_layer_ids],
        "mask_token_id": dc.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        **head_keys(dc, embedding=False),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": dc.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": meta.get("target"), "architectures": list(verifier_architectures or [])},
        },
        **({"dtype": dtype_name} if dtype_name is not None else {}),
        "dflash_trainer": trainer_block(dc, meta, meta.get("chat_template")),
    }


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_export(out: Path, fmt: str, dc: DrafterConfig, weights: dict[str, torch.Tensor], meta: dict[str, Any], *,
                 dtype: torch.dtype | None = None, mask_token: str | None = None,
                 verifier_architectures: list[str] | None = None, speculation: dict[str, Any] | None = None) -> Path:
    """Write a `fmt` folder at `out` (created atomically; an existing non-empty folder is refused).

    weights: our drafter names (trainable_state_dict / load_drafter). dtype: cast floating tensors
    to it (None = keep). meta: `target`, `chat_template`, `enable_thinking`, `mask_token_reason`,
    `step` (missing keys are written as null). speculation: the `speculation.json` sidecar's content
    (interop/speculation.py; None = not written). Returns `out`. Raises ValueError for an unknown
    format, mismatched weights, a non-empty `out`, a control drafter (no_target_features) or, for
    speculators, a drafter with an embedding scale.
    """
    check_format(fmt)
    if meta.get("no_target_features"):
        raise ValueError("this drafter was trained without target features (a control run); serving engines always "
                         "feed the target's features, so it cannot be exported")
    if fmt == "speculators":
        check_speculators_head(dc)
    out = Path(out)
    check_creatable(str(out), "--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not empty; choose a new folder")
    tensors = to_external(weights, fmt, dc.num_hidden_layers)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in tensors.items()}
    dtypes = {t.dtype for t in tensors.values()}
    dtype_name = _dtype_name(dtypes.pop()) if len(dtypes) == 1 else None
    if fmt == "zlab":
        config = zlab_config(dc, meta, dtype_name=dtype_name, mask_token=mask_token)
    else:
        config = speculators_config(dc, meta, dtype_name=dtype_name, verifier_architectures=verifier_architectures)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if meta.get("chat_template"):
            (tmp / CHAT_TEMPLATE_FILE).write_text(meta["chat_template"])
        if speculation is not None:
            (tmp / SPECULATION_FILE).write_text(json.dumps(speculation, indent=2) + "\n")
        _fsync_tree(tmp)
        umask = os.umask(0)
        os.umask(umask)
        # mkdtemp (and safetensors) create private files; an export is meant to be shared.
        os.chmod(tmp, 0o777 & ~umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _fingerprints(weights: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[str, ...]:
    """The exported weights' fingerprint (cast to `dtype` as write_export casts them), then the source's
    when the cast changes it (an fp16 export rounds otherwise than bf16)."""
    cast = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in weights.items()}
    exported, source = weights_fingerprint(cast), weights_fingerprint(weights)
    return (exported,) if exported == source else (exported, source)


def export_drafter(source: str | Path, fmt: str, out: str | Path, *, dtype: torch.dtype | None = None,
                   target: str | None = None, read_target: bool = True,
                   verifier: str | None = None,
                   speedup_from: str | Path | None = None) -> tuple[Path, dict[str, Any], list[str]]:
    """Load `source` (checkpoint, zlab or speculators folder) and write it as `fmt` at `out`.

    target: the target folder / .gguf whose tokenizer names the mask token (SGLang checks it) and
    whose config gives the verifier's hub id and architectures (speculators); None = the target
    recorded in the source's metadata, when it is on this machine (the embedded SmolLM2 is found
    by its hub id too). read_target=False skips reading it. verifier: the verifier's
    `name_or_path` (None = by the rules of interop/verifier.py). speedup_from: an eval result JSON
    with a speedup table, whose draft length per batch size goes into `speculation.json` (None: the
    sidecar records only B−1, the most the drafter proposes). The exported config names the
    target by that portable name (never the training machine's path). A target that cannot be
    read, and a verifier name that is only a folder name, are reported in the returned notes, not
    raised: the export is valid without them; so is a zlab folder with an embedding scale that
    vLLM and SGLang do not read (`ZLAB_SCALE_NOTE`). Returns (out, the source's metadata, notes).
    """
    from dflash_trainer.interop.verifier import known_target_facts, local_target, target_verifier_facts, verifier_name
    from dflash_trainer.target_model.load import load_tokenizer

    speedup_eval = read_speedup_eval(speedup_from) if speedup_from is not None else None  # before the weights load
    dc, weights, meta = load_drafter(source)
    speculation = speculation_sidecar(dc.block_size, speedup_eval,
                                      Path(speedup_from).name if speedup_from is not None else None,
                                      _fingerprints(weights, dtype) if speedup_eval is not None else ())
    notes: list[str] = []
    recorded = meta.get("target")
    here = target or local_target(recorded)
    mask_token, facts = meta.get("mask_token"), None
    if read_target and here:
        try:
            mask_token = mask_token_text(load_tokenizer(here), dc.mask_token_id)
            facts = target_verifier_facts(here)
        except Exception as e:  # optional facts: any failure to read a third-party tokenizer is reported
            notes.append(f"target {here} not read ({e}); mask token name and verifier architectures omitted")
    elif read_target and recorded:
        notes.append(f"target {recorded} is not on this machine; pass --target to name the mask token and the "
                     "verifier architectures")
    elif read_target:
        notes.append("no target known; mask token name and verifier architectures omitted")
    if facts is None:
        facts = known_target_facts(here or recorded) if (here or recorded) else None
    name, warning = verifier_name(verifier, facts, recorded, here)
    if warning and fmt == "speculators":  # vLLM serves the target named there; zlab engines take it from the CLI
        notes.append(warning)
    archs = facts.architectures if facts is not None else list(meta.get("verifier_architectures") or [])
    path = write_export(Path(out), fmt, dc, weights, {**meta, "target": name}, dtype=dtype, mask_token=mask_token,
                        verifier_architectures=archs, speculation=speculation)
    if fmt == "zlab" and dc.embedding_scale != 1.0:
        notes.append(ZLAB_SCALE_NOTE.format(scale=dc.embedding_scale))
    return path, meta, notes
