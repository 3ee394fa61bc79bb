"""What a path given to a flag is, and whether it is what the flag needs.

Every command checks its path flags here before it creates, imports or loads anything: file-system
tests and small reads only (config.json, train_config.json, the first bytes of a file); no torch,
no tokenizer, no model. A refusal is one ValueError / FileNotFoundError that names the flag, says
what the path is and what the flag expects, e.g. "--target runs/x/export-zlab is a drafter (zlab
export), not a target model: pass the target the drafter was trained for". Whether an output path
can be created at all: files/writable.py.

What a folder is (`what_is`), by the first rule that fits:
  drafter        a config.json that `interop.formats.detect_kind` recognizes: a dflash-train
                 checkpoint, a zlab export or a speculators export
  target model   a config.json of a causal LM (architectures ending in ForCausalLM, LMHeadModel or
                 ForConditionalGeneration; or a model_type without architectures)
  run folder     train_config.json (or another of RUN_RECORDS) or checkpoint-* folders (what
                 `train --out` writes)
  prepared data  train/ saved by `datasets`, or prepare_report.json (what `prepare --out` writes)
  GGUF folder    *.gguf files and no config.json
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.interop.formats import CONFIG_FILE, detect_kind
from dflash_trainer.files.writable import check_creatable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
RUN_RECORDS = ("train_config.json", "provenance.json", "metrics.jsonl", "summary.json", "layout.json")
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_FILE_SUFFIXES = (".json", ".jsonl", ".gguf", ".yaml", ".yml", ".jinja", ".txt", ".safetensors")
_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DRAFTER_KINDS = {"checkpoint": "dflash-train checkpoint", "zlab": "zlab export", "speculators": "speculators export"}
_STEP = re.compile(r"checkpoint-(\d+)$")

DRAFTER_HINT = "pass a checkpoint folder (e.g. runs/NAME/checkpoint-final) or a zlab / speculators export"
TARGET_HINT = ("pass an HF model folder (config.json and tokenizer files), a .gguf file or a target name "
               "(smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m)")
CHAT_HINT = "pass a JSON/JSONL chat file (ShareGPT or OpenAI messages)"


@dataclass(frozen=True)
class Found:
    """What a path is. kind: missing | gguf | json | yaml | file | drafter | target | model |
    bad-config | run | prepared | gguf-folder | empty | folder. detail: the drafter kind, the
    architecture or the entries named in the description. target: the target that a drafter or a
    run folder records (None when it records none)."""

    kind: str
    detail: str = ""
    target: str | None = None

    def __str__(self) -> str:
        return {
            "missing": "missing", "gguf": "a GGUF file", "json": "a JSON/JSONL file", "yaml": "a YAML file",
            "file": "a file", "drafter": f"a drafter ({self.detail})",
            "target": f"a target model folder ({self.detail})",
            "model": f"a folder whose config.json is no causal LM ({self.detail})",
            "bad-config": f"a folder whose config.json is unreadable ({self.detail})",
            "run": "a run folder of `dflash-train train`",
            "prepared": "a prepared-data folder (from `dflash-train prepare`)",
            "gguf-folder": f"a folder holding {self.detail} but no config.json",
            "empty": "an empty folder", "folder": f"a folder ({self.detail})",
        }[self.kind]


def what_is(path: str | Path) -> Found:
    """What `path` is (see the module docstring), from file names, config.json and at most the
    first 4 KiB of a file."""
    p = Path(path).expanduser()
    if not p.exists():
        return Found("missing")
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix == ".gguf":
            return Found("gguf")
        if suffix in (".yaml", ".yml"):
            return Found("yaml")
        return Found("json") if suffix in (".json", ".jsonl") or _head(p)[:1] in ("{", "[") else Found("file")
    if (p / CONFIG_FILE).is_file():
        return _config_folder(p)
    try:
        names = sorted(c.name for c in p.iterdir())
    except OSError as e:  # a folder this user cannot list
        return Found("folder", f"unreadable: {e.strerror}")
    if set(RUN_RECORDS) & set(names) or any(n.startswith("checkpoint-") and (p / n).is_dir() for n in names):
        return Found("run", target=_recorded_run_target(p))
    if ((p / "train").is_dir() and any((p / "train" / f).is_file() for f in ("state.json", "dataset_info.json"))
            or "prepare_report.json" in names):
        return Found("prepared")
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if ggufs:
        return Found("gguf-folder", ", ".join(ggufs[:3]))
    if not names:
        return Found("empty")
    return Found("folder", f"{len(names)} {'entry' if len(names) == 1 else 'entries'}, no config.json")


def _config_folder(p: Path) -> Found:
    """A folder with config.json: drafter, target model or another model."""
    try:
        body = json.loads((p / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        return Found("bad-config", str(e)[:80])
    if not isinstance(body, dict):
        return Found("bad-config", "not a JSON object")
    try:
        kind = detect_kind(body)
        return Found("drafter", _DRAFTER_KINDS[kind], target=_recorded_drafter_target(body))
    except ValueError:
        pass
    archs = body.get("architectures") or []
    if archs:
        if any(str(a).endswith(_CAUSAL_SUFFIXES) for a in archs):
            return Found("target", str(archs[0]))
        return Found("model", f"architectures {archs}")
    if body.get("model_type"):
        return Found("target", f"model_type {body['model_type']}")
    return Found("model", "neither architectures nor model_type")


def _recorded_drafter_target(body: dict[str, Any]) -> str | None:
    """The target a drafter's config.json names: the checkpoint's `dflash` block, an export's
    `dflash_trainer` block, or the speculators verifier."""
    for block in (body.get("dflash"), body.get("dflash_trainer")):
        if isinstance(block, dict) and block.get("target"):
            return str(block["target"])
    config = body.get("speculators_config")
    verifier = config.get("verifier") if isinstance(config, dict) else None
    return str(verifier["name_or_path"]) if isinstance(verifier, dict) and verifier.get("name_or_path") else None


def _recorded_run_target(p: Path) -> str | None:
    """The target a run folder's train_config.json names (None: none, or the embedded default);
    `target.path` of a nested config, `target` of the flat one of earlier releases."""
    try:
        target = json.loads((p / "train_config.json").read_text()).get("target")
        target = target.get("path") if isinstance(target, dict) else target
    except (OSError, ValueError, AttributeError):
        return None
    return str(target) if target else None


def _head(p: Path, size: int = 4096) -> str:
    """The first `size` bytes of a file as text, leading blanks dropped ("" when unreadable)."""
    try:
        with p.open("rb") as f:
            return f.read(size).decode("utf-8", errors="replace").lstrip()
    except OSError:
        return ""


def _first_line(p: Path) -> str:
    """The first line of a file, at most 24 characters (for a message)."""
    return (_head(p, 24).splitlines() or [""])[0]


def looks_like_hub_id(value: str) -> bool:
    """True for `org/name` (or an hf:// / https:// address) that is no local path: two name parts,
    no known file suffix, and no local folder `org`."""
    if value.startswith(("hf://", "http://", "https://")):
        return True
    parts = value.split("/")
    return (len(parts) == 2 and all(_HUB_PART.fullmatch(s) for s in parts) and not Path(parts[0]).exists()
            and Path(value).suffix.lower() not in _FILE_SUFFIXES)


def refuse_hub_id(flag: str, value: str, what: str) -> None:
    """Raise FileNotFoundError when `value` looks like a hub id (`looks_like_hub_id`), saying to
    pass `what` instead."""
    if looks_like_hub_id(value) and not Path(value).expanduser().exists():
        raise FileNotFoundError(f"{flag} {value} is no local path and looks like a Hugging Face hub id; dflash-train "
                                f"reads local files only and downloads nothing: download it and {what}")


def _close_name(value: str) -> str:
    """'did you mean NAME? ' for the target name (`target_names`) closest to `value`, case ignored; '' if none
    or when `value` is a path (a folder part or a .gguf suffix: a missing file, not a misspelt name)."""
    import difflib

    from dflash_trainer.target_model.paths import target_names

    if "/" in value or value.lower().endswith(".gguf"):
        return ""

    lower = {n.lower(): n for n in target_names()}
    close = difflib.get_close_matches(value.lower(), list(lower), n=1, cutoff=0.75)
    return f"did you mean {lower[close[0]]}? Else " if close else ""


def _refused(flag: str, value: Any, found: Found, expected: str, fix: str) -> ValueError:
    return ValueError(f"{flag} {value} is {found}, not {expected}: {fix}")


def check_target(value: str | None, flag: str = "--target") -> None:
    """Raise unless `value` is a target: an HF folder of a causal LM with tokenizer files, a GGUF
    file, or a target name (`smollm2-135m`, `qwen2.5-coder-0.5b`, `gemma3-270m`: its files must be
    here, the message names the fetch command); None is the embedded GGUF (its package must be installed)."""
    from dflash_trainer.target_model.paths import embedded_gguf_path, named_target

    if value is None:
        embedded_gguf_path()
        return
    if named_target(value) is not None:
        return
    refuse_hub_id(flag, value, "pass the local folder or a .gguf file")
    p = Path(value).expanduser()
    found = what_is(p)
    if found.kind == "missing":
        what = "GGUF file" if p.suffix.lower() == ".gguf" else "path"
        raise FileNotFoundError(f"{flag} {value}: {what} not found; {_close_name(value)}{TARGET_HINT}")
    if found.kind == "gguf":
        head = _head(p, 4)
        if head != "GGUF":
            raise ValueError(f"{flag} {value} is a file named .gguf that does not start with GGUF (it starts with "
                             f"{_first_line(p)!r}; a Git LFS pointer?): fetch the real file")
        return
    if found.kind == "target":
        if not any((p / f).is_file() for f in TOKENIZER_FILES) and not any(p.glob("*.tiktoken")):
            raise ValueError(f"{flag} {value} is {found} without tokenizer files ({', '.join(TOKENIZER_FILES)}): "
                             "copy the model's tokenizer files into it")
        return
    recorded = f" ({found.target})" if found.target else ""
    fixes = {
        "drafter": f"pass the target the drafter was trained for{recorded}",
        "run": f"pass the target the run trained with{recorded or ' (its train_config.json records it)'}",
        "prepared": f"{TARGET_HINT}; prepared rows go to --prepared",
        "json": f"{TARGET_HINT}; chat data goes to --data",
        "gguf-folder": f"pass the file itself, e.g. {flag} {p / found.detail.split(', ')[0]}",
    }
    raise _refused(flag, value, found, "a target model", fixes.get(found.kind, TARGET_HINT))


def _newest_checkpoint(run: Path) -> Path | None:
    """checkpoint-final of a run folder when it is a drafter, else its highest checkpoint-N."""
    if what_is(run / "checkpoint-final").kind == "drafter":
        return run / "checkpoint-final"
    steps = sorted((int(m.group(1)), c) for c in run.iterdir() if (m := _STEP.match(c.name)) and c.is_dir())
    return steps[-1][1] if steps else None


def check_drafter(value: str, flag: str, *, run_folder: bool = False) -> Path:
    """The drafter folder `value` names (a checkpoint, zlab or speculators export, with weights);
    run_folder: a run folder stands for its checkpoint-final. Raises naming the flag otherwise."""
    refuse_hub_id(flag, value, "pass a local drafter folder")
    p = Path(value).expanduser()
    found = what_is(p)
    if found.kind == "run":
        newest = _newest_checkpoint(p)
        if run_folder and newest is not None and newest.name == "checkpoint-final":
            p, found = newest, what_is(newest)
        else:
            example = newest or p / "checkpoint-final"
            raise _refused(flag, value, found, "a drafter folder",
                           f"pass one of its checkpoints, e.g. {flag} {example}")
    if found.kind == "drafter":
        if not any(p.glob("*.safetensors")):
            raise ValueError(f"{flag} {value} is {found} without weights (no *.safetensors): copy the whole folder")
        return p
    if found.kind == "missing":
        raise FileNotFoundError(f"{flag} {value}: not found; {DRAFTER_HINT}")
    if found.kind == "model" and (p / CONFIG_FILE).is_file():
        try:
            detect_kind(json.loads((p / CONFIG_FILE).read_text()))
        except ValueError as e:  # config.json that is no drafter: say why (detect_kind's message)
            raise ValueError(f"{flag} {value}: {e}; {DRAFTER_HINT}") from None
    no_config = "" if (p / CONFIG_FILE).is_file() else " (no config.json)"
    raise _refused(flag, value, found, f"a drafter folder{no_config}", DRAFTER_HINT)


def check_chat_file(value: str | None, flag: str = "--data") -> None:
    """Raise unless `value` (when set) is a JSON/JSONL file: it exists, is a file, and its first
    character is `{` or `[`."""
    if value is None:
        return
    refuse_hub_id(flag, value, "pass a local JSON/JSONL chat file")
    p = Path(value).expanduser()
    found = what_is(p)
    if found.kind == "missing":
        raise FileNotFoundError(f"{flag} {value}: file not found; {CHAT_HINT}")
    if p.is_dir():
        fix = "pass it as --prepared" if found.kind == "prepared" else CHAT_HINT
        raise _refused(flag, value, found, "a chat file", fix)
    head = _head(p)
    if head[:1] not in ("{", "["):
        said = "an empty file" if not head else f"a file starting with {_first_line(p)!r}"
        raise ValueError(f"{flag} {value} is {said}, not a JSON/JSONL chat file: {CHAT_HINT}")


def check_prepared(value: str | None, flag: str = "--prepared") -> None:
    """Raise unless `value` (when set) is a folder written by `dflash-train prepare` (train/ saved by
    `datasets`, or prepare_report.json)."""
    if value is None:
        return
    p = Path(value).expanduser()
    found = what_is(p)
    if found.kind == "prepared":
        return
    if found.kind == "missing":
        raise FileNotFoundError(f"{flag} {value}: not found; run `dflash-train prepare --out {value}` first, "
                                "or give the chat file as --data")
    fixes = {"json": "pass it as --data (the run prepares it), or run `dflash-train prepare` on it first",
             "run": f"its prepared rows are in {p / 'data'}" if what_is(p / "data").kind == "prepared" else
                    "run `dflash-train prepare` first"}
    raise _refused(flag, value, found, "a prepared-data folder (train/ and validation/)",
                   fixes.get(found.kind, "run `dflash-train prepare --out FOLDER` first"))


def check_run_out(value: str, flag: str = "--out") -> None:
    """Raise unless `value` can be a run folder: new (creatable), empty, an earlier run's folder
    (resumed or reported finished), or a folder holding only prepared rows and hidden files (e.g.
    `prepare --out runs/x/data` before `train --out runs/x`); never a file, a model, a drafter,
    prepared data itself or a folder holding other things."""
    check_creatable(value, flag)
    found = what_is(value)
    if found.kind == "folder":
        p = Path(value).expanduser()
        if all(c.name.startswith(".") or what_is(c).kind == "prepared" for c in p.iterdir()):
            return
    if found.kind not in ("missing", "empty", "run"):
        raise _refused(flag, value, found, "a run folder",
                       "choose a new folder (e.g. runs/NAME), or an earlier run's folder to resume it")


def check_run_dir(value: str, flag: str = "RUN_DIR") -> None:
    """Raise unless `value` is a run folder (`what_is` kind run), the folder `report` plots."""
    fix = "pass the --out folder of a `dflash-train train` run (it holds metrics.jsonl)"
    found = what_is(value)
    if found.kind == "missing":
        raise FileNotFoundError(f"{flag} {value}: not found; {fix}")
    if found.kind != "run":
        raise _refused(flag, value, found, "a run folder", fix)


def check_new_folder(value: str, flag: str = "--out", *, reuse: str | None = None) -> None:
    """Raise unless `value` is a new or empty folder that can be created; reuse: a `what_is` kind
    that may be written over (e.g. "prepared" for `prepare --out`)."""
    check_creatable(value, flag)
    found = what_is(value)
    if found.kind not in ("missing", "empty", reuse):
        raise ValueError(f"{flag} {value}: exists and is not empty ({found}); choose a new folder")


def check_drafter_config_file(value: str | None, flag: str = "--drafter-config") -> None:
    """Raise unless `value` (when set) is a drafter config JSON file as `init-config` writes it
    (a JSON object with hidden_size and target_layer_ids)."""
    if value is None:
        return
    p = Path(value).expanduser()
    found = what_is(p)
    if found.kind == "missing":
        raise FileNotFoundError(f"{flag} {value}: file not found; write one with `dflash-train init-config --out FILE`")
    fix = "write one with `dflash-train init-config --out FILE`"
    if found.kind == "drafter":
        fix = "pass the folder as --init-from (warm start from its weights), or " + fix
    if p.is_dir():
        raise _refused(flag, value, found, "a drafter config file", fix)
    try:
        body = json.loads(p.read_text())
    except (OSError, ValueError):
        raise _refused(flag, value, found, "a drafter config JSON", fix) from None
    if not isinstance(body, dict) or not {"hidden_size", "target_layer_ids"} <= body.keys():
        raise ValueError(f"{flag} {value} is a JSON file without hidden_size and target_layer_ids, not a drafter "
                         f"config: {fix}")
