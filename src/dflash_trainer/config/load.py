"""Where a TrainConfig comes from: defaults < YAML file (`--config FILE`) < explicit CLI flags <
`--set section.field=value`; and the JSON it is written back as. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dflash_trainer.config.fields import unknown_keys_message
from dflash_trainer.config.schema import SECTIONS, TrainConfig, nest_values, resolve_key, saved_config


def check_yaml_mapping(value: str, flag: str, example: str = "") -> dict[str, Any]:
    """The mapping a YAML file holds; raises naming the flag when the file is missing, a folder,
    not YAML, or not a mapping."""
    p = Path(value).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{flag} {value}: file not found{example}")
    if not p.is_file():
        raise ValueError(f"{flag} {value} is a folder, not a YAML file{example}")
    try:
        body = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ValueError(f"{flag} {value}: not valid YAML{at}; fix the file") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ValueError(f"{flag} {value} holds a YAML {type(body).__name__}, not a mapping of field: value")
    return body

def _parse_value(raw: str) -> Any:
    """Parse a `--set` value as YAML (numbers, bools, null, lists) falling back to the string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _refuse_twice_set(body: dict[str, Any], source: str) -> None:
    """Raise ValueError when one file sets a setting twice (a bare or dotted key beside its section's
    mapping, e.g. `max_steps: 5` and `optim: {max_steps: 9}`): which one wins would hang on the
    order of the keys in the file."""
    seen: dict[str, str] = {}
    for raw, value in body.items():
        key = str(raw).strip().replace("-", "_")
        if key in SECTIONS and value is None:  # a section whose fields are all commented out
            continue
        names = ([f"{key}.{k}" for k in value] if key in SECTIONS and isinstance(value, dict)
                 else [resolve_key(key) or key])
        for name in names:
            if name in seen:
                raise ValueError(f"{source} sets {name} twice ({seen[name]!r} and {key!r}): keep one")
            seen[name] = key


def load_config(config_file: str | None = None, overrides: dict[str, Any] | None = None,
                sets: list[str] | None = None) -> TrainConfig:
    """Build a TrainConfig (returned) from defaults, an optional YAML file, CLI overrides and
    `key=value` sets, each layer over the one before, setting by setting.

    config_file: YAML nested by section (`optim: {lr: 1e-3}`); a flat key is read like a bare
    `--set` key. overrides: explicit CLI flags keyed `section.field` or by bare field name (None
    values are ignored). sets: strings "section.field=value" (canonical) or "field=value" with a
    bare field name. Raises ValueError naming the source and suggesting fields for unknown keys,
    and with the setting and message when validation fails; FileNotFoundError when the config
    file is missing.
    """
    layers: list[tuple[dict[str, Any], str]] = []
    if config_file:
        body = check_yaml_mapping(config_file, "--config", " (e.g. configs/qwen3-8b.yaml)")
        _refuse_twice_set(body, f"--config {config_file}")
        layers.append((body, f"--config {config_file}"))
    layers.append(({k: v for k, v in (overrides or {}).items() if v is not None}, "flag"))
    parsed: dict[str, Any] = {}
    for s in sets or []:
        if "=" not in s:
            raise ValueError(f"--set {s!r}: expected section.field=value")
        k, v = s.split("=", 1)
        parsed[k.strip()] = _parse_value(v)
    layers.append((parsed, "--set"))
    data: dict[str, Any] = {}
    unknown: dict[str, str] = {}  # key → where it came from, for the unknown-key message
    for values, source in layers:
        nested, bad = nest_values(values)
        unknown.update(dict.fromkeys(bad, source))
        for key, value in nested.items():
            data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    if unknown:
        raise ValueError(unknown_keys_message(unknown))
    try:
        return TrainConfig(**data)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"invalid config: {msgs}") from None


def dump_config(cfg: TrainConfig, path: Path) -> None:
    """Write the resolved config as JSON (`saved_config`: every field, defaults included, nested by
    section, with format_version). Raises OSError when the file cannot be written."""
    path.write_text(json.dumps(saved_config(cfg), indent=2) + "\n")
