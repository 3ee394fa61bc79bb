"""Who the verifier is, in words a serving engine on another machine understands.

`vllm serve EXPORT` on a speculators folder loads the model named by
`speculators_config.verifier.name_or_path` as the target (vLLM `maybe_override_with_speculators`),
so that name must be a hub id or a path valid where the folder is served — never the path of the
target on the training machine (for the embedded SmolLM2, a file inside a virtualenv).

Rules (`verifier_name`): `--verifier` when given; else the target's hub id when known — the
embedded GGUF is `HuggingFaceTB/SmolLM2-135M-Instruct`, a packaged GGUF target its table's hub id
(`Qwen/Qwen2.5-Coder-0.5B-Instruct`, `google/gemma-3-270m`), an HF folder's `config.json`
`_name_or_path` when it looks like `org/name`, a GGUF's `general.source.huggingface.repository`
or huggingface.co source URL; else a recorded name that already looks like a hub id (re-exporting
an export); else the target folder's (or file's) name, with a warning to set `--verifier`.
Architectures come from the target's config (`architectures`, else its `model_type` mapped to the
transformers causal-LM class; a GGUF's `general.architecture` likewise).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trainer.target_model.packaged_targets import packaged_gguf_path, packaged_target_of
from dflash_trainer.target_model.paths import (EMBEDDED_ARCHITECTURES, EMBEDDED_GGUF, EMBEDDED_HUB_ID, EMBEDDED_NAME,
                                               embedded_gguf_path, resolve_target_path)

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_HF_URL = re.compile(r"https?://(?:www\.)?huggingface\.co/([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)")


def looks_like_hub_id(name: str | None) -> bool:
    """True for `org/name` (one slash, hub characters, no `..`): a name, not a local path."""
    return bool(name) and _HUB_ID.fullmatch(name) is not None and ".." not in name


def is_embedded(target: str | None) -> bool:
    """Whether `target` (a recorded target: path or name) denotes the embedded SmolLM2 GGUF."""
    return target is not None and (target in (EMBEDDED_HUB_ID, EMBEDDED_NAME) or Path(target).name == EMBEDDED_GGUF)


def local_target(recorded: str | None) -> str | None:
    """A target path on this machine for a recorded target (checkpoint or export metadata): the path
    itself when it exists here; else the embedded GGUF, or a fetched packaged GGUF, for its name,
    hub id or its path on any machine; None when it cannot be read here (another hub id, another
    machine's path, a packaged target not fetched here, nothing recorded)."""
    if recorded is None:
        return None
    if Path(recorded).expanduser().exists():
        return recorded
    packaged = packaged_target_of(recorded)
    try:
        if is_embedded(recorded):
            return str(embedded_gguf_path())
        return str(packaged_gguf_path(packaged.name)) if packaged is not None else None
    except FileNotFoundError:
        return None


def causal_lm_architectures(model_type: str | None) -> list[str]:
    """`["LlamaForCausalLM"]` for model_type "llama" (transformers' causal-LM table); [] if unknown."""
    if not model_type:
        return []
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [arch] if arch else []


@dataclass
class VerifierFacts:
    """What the target's files say about it: a hub id (None when they do not say) and architectures."""

    hub_id: str | None = None
    architectures: list[str] = field(default_factory=list)


def _gguf_facts(file: Path) -> VerifierFacts:
    from gguf import GGUFReader  # parses the header and tensor table (~5 s for SmolLM2 on 2 cores)

    fields = GGUFReader(str(file)).fields

    def text(key: str) -> str | None:
        f = fields.get(key)
        try:
            value = f.contents() if f is not None else None
        except Exception:  # a malformed optional field: treat as absent
            return None
        return value if isinstance(value, str) else None

    hub = text("general.source.huggingface.repository")
    if not looks_like_hub_id(hub):
        urls = [text(k) for k in ("general.source.url", "general.source.repo_url")]
        hub = next((m.group(1) for u in urls if u and (m := _HF_URL.match(u))), None)
    return VerifierFacts(hub, causal_lm_architectures(text("general.architecture")))


def embedded_facts() -> VerifierFacts:
    """The embedded SmolLM2's hub id and architectures (known without reading the GGUF)."""
    return VerifierFacts(EMBEDDED_HUB_ID, list(EMBEDDED_ARCHITECTURES))


def known_target_facts(target: str | None) -> VerifierFacts | None:
    """Hub id and architectures of the embedded SmolLM2 (None included) or a packaged target
    (packaged_targets.py), by name, hub id or GGUF file name, without reading files; None otherwise."""
    if target is None or is_embedded(target):
        return embedded_facts()
    packaged = packaged_target_of(target)
    return VerifierFacts(packaged.hub_id, list(packaged.architectures)) if packaged is not None else None


def target_verifier_facts(target: str | None) -> VerifierFacts:
    """Hub id and architectures of a target on this machine (None = the embedded SmolLM2), known
    (`known_target_facts`) or read from config.json or the GGUF header; no weights. Raises what
    reading the files raises."""
    known = known_target_facts(target)
    if known is not None:
        return known
    folder, gguf = resolve_target_path(target)
    if gguf:
        return _gguf_facts(folder / gguf)
    body: dict[str, Any] = json.loads((folder / "config.json").read_text())
    name = body.get("_name_or_path")
    archs = list(body.get("architectures") or []) or causal_lm_architectures(body.get("model_type"))
    return VerifierFacts(name if looks_like_hub_id(name) else None, archs)


def fallback_name(target: str | None) -> str | None:
    """The target folder's name (a GGUF file: its name without `.gguf`); never a full path."""
    if not target:
        return None
    p = Path(target)
    return p.stem if p.suffix.lower() == ".gguf" else p.name


def verifier_name(given: str | None, facts: VerifierFacts | None, recorded: str | None,
                  target: str | None) -> tuple[str | None, str | None]:
    """(name_or_path for the export, a warning or None), by the rules in the module docstring.

    given: `--verifier`. facts: from `target_verifier_facts` (None when the target was not read).
    recorded: the target named in the source's metadata. target: the target path used here.
    """
    if given:
        return given, None
    if facts is not None and facts.hub_id:
        return facts.hub_id, None
    if looks_like_hub_id(recorded):
        return recorded, None
    name = fallback_name(target or recorded)
    what = f"{name!r} (the target's folder name)" if name else "no name"
    return name, (f"the verifier's hub id is unknown, so the export names {what}; pass --verifier HUB_ID "
                  "(or the path where the target is served) so `vllm serve EXPORT` loads the right target")
