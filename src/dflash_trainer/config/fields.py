"""What `dflash-train config` shows and what an unknown config key suggests: every `TrainConfig`
setting (`section.field`) with its section, type, default and description, and the nearest
settings to a mistyped or borrowed name (by spelling, and by the names other trainers use:
learning_rate → optim.lr; a former name such as `target` → target.path).

Torch-free: the CLI answers in about a second.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any

import annotated_types

from dflash_trainer.config.schema import FIELD_SECTION, RENAMED, SECTIONS, TOP_LEVEL, TrainConfig, resolve_key

# Names other trainers (HF Trainer, torchtitan, speculators, EAGLE scripts) use for our fields.
# Keys are lower case with '_' for '-'; a value is the field a user most likely means (bare names
# here, `section.field` in SYNONYMS below).
_SYNONYM_FIELDS: dict[str, str] = {
    **dict.fromkeys(("learning_rate", "learningrate", "peak_lr", "max_lr", "base_lr"), "lr"),
    **dict.fromkeys(("batch_size", "batch", "train_batch_size", "micro_batch_size", "global_batch_size",
                     "per_device_train_batch_size", "gradient_accumulation_steps", "rows"), "rows_per_step"),
    **dict.fromkeys(("steps", "num_steps", "train_steps", "total_steps", "num_train_steps", "max_train_steps",
                     "iterations", "iters", "max_iters"), "max_steps"),
    **dict.fromkeys(("num_draft_layers", "draft_layers", "n_layers", "num_hidden_layers", "layers", "depth",
                     "drafter_layers"), "num_layers"),
    **dict.fromkeys(("block", "block_len", "block_length", "draft_length", "draft_len", "num_speculative_tokens",
                     "speculative_tokens"), "block_size"),
    **dict.fromkeys(("warmup", "warmup_steps", "num_warmup_steps", "warmup_fraction"), "warmup_ratio"),
    **dict.fromkeys(("max_seq_len", "seq_length", "max_length", "max_seq_length", "seqlen", "sequence_length",
                     "context_length", "max_len", "row_len", "pack_len"), "seq_len"),
    **dict.fromkeys(("anchors", "n_anchors", "num_blocks", "blocks_per_row", "max_anchors"), "num_anchors"),
    **dict.fromkeys(("epochs_num", "num_epochs", "num_train_epochs", "n_epochs", "epoch"), "epochs"),
    **dict.fromkeys(("grad_norm", "max_grad_norm", "clip_grad_norm", "gradient_clipping", "clip_grad", "clip"),
                    "grad_clip"),
    **dict.fromkeys(("wd", "decay_weight"), "weight_decay"),
    **dict.fromkeys(("output_dir", "output", "out_dir", "run_dir", "save_dir", "output_path", "log_dir"), "out"),
    **dict.fromkeys(("model", "target_model", "model_name", "model_path", "base_model", "verifier",
                     "model_name_or_path", "target_path", "target_model_path"), "path"),
    **dict.fromkeys(("dataset", "train_data", "data_path", "train_file", "dataset_path", "train_dataset",
                     "data_file"), "chats"),
    **dict.fromkeys(("prepared_data", "prepared_dir", "data_dir"), "prepared"),
    **dict.fromkeys(("min_lr", "lr_min", "final_lr_ratio"), "min_lr_ratio"),
    **dict.fromkeys(("save_steps", "checkpoint_every", "ckpt_every", "save_interval"), "save_every"),
    **dict.fromkeys(("log_steps", "logging_steps", "log_interval"), "log_every"),
    **dict.fromkeys(("resume_from", "resume_from_checkpoint"), "resume"),
    **dict.fromkeys(("gradient_checkpointing", "activation_checkpointing"), "checkpoint_layers"),
    **dict.fromkeys(("target_layers", "feature_layers", "aux_hidden_state_layer_ids", "layer_ids"),
                    "target_layer_ids"),
    **dict.fromkeys(("num_target_layers", "num_features"), "num_target_features"),
    **dict.fromkeys(("mask_token", "mask_id"), "mask_token_id"),
    **dict.fromkeys(("window", "window_size", "swa_window"), "sliding_window"),
    **dict.fromkeys(("drafter", "draft_model", "drafter_path", "pretrained", "init_checkpoint", "from_pretrained"),
                    "init_from"),
    **dict.fromkeys(("val_fraction", "validation_split", "eval_fraction", "val_split"), "validation_fraction"),
    **dict.fromkeys(("num_conversations", "max_samples", "max_examples", "num_samples"), "max_conversations"),
    **dict.fromkeys(("template",), "chat_template"),
    **dict.fromkeys(("thinking",), "enable_thinking"),
    **dict.fromkeys(("kl_weight",), "loss_kl_weight"),
    **dict.fromkeys(("ce_weight",), "loss_ce_weight"),
    **dict.fromkeys(("decay", "loss_decay"), "gamma"),
    **dict.fromkeys(("dropout",), "feature_dropout"),
    **dict.fromkeys(("torch_compile",), "compile"),
    **dict.fromkeys(("compile_target",), "target_compile"),
    **dict.fromkeys(("float8", "use_fp8", "fp8_training", "float8_training", "fp8_recipe"), "fp8"),
    **dict.fromkeys(("loss_type", "loss_kind", "objective"), "kind"),
}
SYNONYMS: dict[str, str] = {k: resolve_key(v) or v for k, v in _SYNONYM_FIELDS.items()}


@dataclass(frozen=True)
class FieldRow:
    """One TrainConfig setting as `dflash-train config` shows it: `group` is its section ("" for a
    top-level field such as `out`), `name` the key users write (`optim.lr`, `out`)."""

    group: str
    name: str
    type: str
    default: Any
    description: str

    @property
    def field(self) -> str:
        """The bare field name (str): `lr` of `optim.lr`."""
        return self.name.rpartition(".")[2]


def _type_name(annotation: Any) -> str:
    """`str | None`, `int`, `target | data` (a Literal lists its values), `list[int] | None`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(annotation))}]"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="))


def _bounds(metadata: list[Any]) -> str:
    """The numeric bounds of a field as `> 0, <= 1` ('' when there are none)."""
    out = []
    for m in metadata:
        for cls, attr, sym in _BOUNDS:
            if isinstance(m, cls):
                out.append(f"{sym} {getattr(m, attr)}")
    return ", ".join(out)


def field_groups() -> dict[str, str]:
    """Setting (`section.field`, or a top-level name) → its section ("" for a top-level field)."""
    return {**dict.fromkeys(TOP_LEVEL, ""), **{f"{s}.{f}": s for f, s in FIELD_SECTION.items()}}


def setting_names() -> list[str]:
    """Every setting's key (list[str]) in display order: the top-level fields, then each section's
    fields as `section.field` in class order."""
    return [*TOP_LEVEL, *(f"{s}.{f}" for s, model in SECTIONS.items() for f in model.model_fields)]


def field_rows() -> list[FieldRow]:
    """Every setting (list[FieldRow]) in display order: section, type (with bounds), default, description."""
    rows = []
    for name in setting_names():
        section, _, field = name.rpartition(".")
        info = SECTIONS[section].model_fields[field] if section else TrainConfig.model_fields[field]
        kind = _type_name(info.annotation)
        bounds = _bounds(info.metadata)
        rows.append(FieldRow(group=section, name=name, type=f"{kind}, {bounds}" if bounds else kind,
                             default=info.default, description=info.description or ""))
    return rows


def suggest_fields(key: str, n: int = 3) -> list[str]:
    """Up to `n` settings (list[str] of `section.field`) a user writing `key` most likely means: the
    new name of a renamed field (target → target.path), a known synonym (learning_rate → optim.lr,
    batch_size → optim.rows_per_step), the field of a wrong section (runtime.lr → optim.lr), then
    fields and synonyms spelled alike."""
    k = key.strip().lower().replace("-", "_")
    bare = k.rpartition(".")[2]
    fields = [*TOP_LEVEL, *FIELD_SECTION]
    out = [RENAMED[k]] if k in RENAMED else []
    out += [SYNONYMS[x] for x in (k, bare) if x in SYNONYMS]
    out += [name for name in [resolve_key(bare)] if name and "." in k]
    out += [resolve_key(f) or f for f in difflib.get_close_matches(bare, fields, n=n, cutoff=0.6)]
    out += [SYNONYMS[s] for s in difflib.get_close_matches(bare, list(SYNONYMS), n=n, cutoff=0.8)]
    return list(dict.fromkeys(f for f in out if f != k))[:n]


def unknown_keys_message(keys: dict[str, str]) -> str:
    """The error (str) for keys that name no setting; `keys` maps each key to where it came from
    (`--set`, `--config FILE`, `flag`). A section name given a value that is not a mapping (the
    former `target`, `data`, `loss` fields) is named as a section. Ends by pointing at
    `dflash-train config`."""
    parts = []
    for key, source in keys.items():
        k = key.strip().replace("-", "_")
        close = [RENAMED[k]] if k in RENAMED else suggest_fields(key)
        hint = f"did you mean {' or '.join(close)}?" if close else "no field is named alike."
        if k in SECTIONS:
            section = key.strip().replace("-", "_")
            hint = hint if close else f"give one of its fields as {section}.FIELD (`dflash-train config {section}`)."
            parts.append(f"{source}: {key!r} is a section of the config, not a field, {hint}")
        else:
            parts.append(f"{source}: {key!r} is not a config field, {hint}")
        # e.g. "--set: 'learning_rate' is not a config field, did you mean optim.lr?"
    return ("invalid config: " + " ".join(parts)
            + " `dflash-train config` lists every field with its type, default and description.")


def matching_rows(rows: list[FieldRow], word: str) -> list[FieldRow]:
    """The rows (list[FieldRow]) of section `word` when it names one (`optim`), else those whose
    name or description contains `word` or that `word` suggests (synonyms, spelling); all rows
    for an empty word."""
    w = word.strip().lower().replace("-", "_")
    if not w:
        return rows
    if w in SECTIONS:
        return [r for r in rows if r.group == w]
    suggested = set(suggest_fields(w, n=5))
    return [r for r in rows if w in r.name or w.replace("_", " ") in r.description.lower() or r.name in suggested]
